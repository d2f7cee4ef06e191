"""The shared types of the tool-call parsers, and the machinery that streams them.

A format marks its tool calls with marker strings (`<tool_call>`, `[ARGS]`, ...). MarkerScanner cuts streamed
text into plain text and markers, holding back only a tail that may still grow into a marker, so any split of an
output yields the same markers between the same text. A format's MarkupStream reads those pieces in order and
emits deltas; ToolParser.parse streams the whole text as one piece and assembles the deltas, so a parsed output
and the same output streamed in any pieces agree by construction.

Each piece of text is read a bounded number of times: a stream's work per feed is the new text plus the held tail.
"""

from __future__ import annotations

import itertools
import secrets
import string
from dataclasses import dataclass

from hybridmoe.server.tool_parsers.scanning import JsonScanner, MarkerScanner, Piece, TextChannel

CALL_ID_CHARS = string.ascii_letters + string.digits


def new_call_id() -> str:
    """A tool call's id: "call_" and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(CALL_ID_CHARS) for _ in range(24))


@dataclass
class ToolCall:
    name: str
    arguments: str
    """The arguments as one JSON object in compact form (compact_json)."""
    id: str


@dataclass
class ParsedOutput:
    content: str | None
    """The text outside tool calls; None when it is empty or whitespace only."""
    tool_calls: list[ToolCall]
    reasoning: str | None = None
    """The text the format marks as reasoning (gpt-oss's analysis channel); None when there is none."""


@dataclass
class Delta:
    """One streamed piece: content, reasoning, or part of the tool call numbered index."""

    content: str | None = None
    reasoning: str | None = None
    index: int | None = None
    """The tool call's index (0, 1, ...) when this delta belongs to a call."""
    id: str | None = None
    """Set on a call's first delta only."""
    name: str | None = None
    """Set on a call's first delta only."""
    arguments: str | None = None
    """A fragment of the call's arguments; a call's fragments in order make its arguments."""


def assemble(deltas: list[Delta]) -> ParsedOutput:
    """The output a sequence of deltas streams: their content, their reasoning and their calls, joined."""
    content, reasoning, calls, arguments = [], [], {}, {}
    for delta in deltas:
        content.append(delta.content or "")
        reasoning.append(delta.reasoning or "")
        if delta.index is not None:
            if delta.index not in calls:
                calls[delta.index] = ToolCall(name=delta.name or "", arguments="", id=delta.id or "")
                arguments[delta.index] = []
            arguments[delta.index].append(delta.arguments or "")
    for index, call in calls.items():
        call.arguments = "".join(arguments[index])
    return ParsedOutput(content=_visible("".join(content)), tool_calls=[calls[i] for i in sorted(calls)],
                        reasoning=_visible("".join(reasoning)))


def _visible(text: str) -> str | None:
    return text if text.strip() else None


class ToolStream:
    """The incremental reader of one choice's output."""

    def feed(self, text: str) -> list[Delta]:
        """The deltas the next piece of decoded output text makes known."""
        raise NotImplementedError

    def finish(self) -> list[Delta]:
        """The output ended: the deltas of what was held back."""
        raise NotImplementedError


class ToolParser:
    """A tool-call format: parse() reads a whole output, stream() gives a fresh reader for one choice."""

    name: str = ""
    stream_class: type[ToolStream]

    def stream(self) -> ToolStream:
        return self.stream_class()

    def parse(self, text: str) -> ParsedOutput:
        reader = self.stream()
        return assemble(reader.feed(text) + reader.finish())


def _text_kind(delta: Delta) -> str | None:
    return "content" if delta.content is not None else "reasoning" if delta.reasoning is not None else None


class MarkupStream(ToolStream):
    """A ToolStream whose format a subclass reads piece by piece: on_piece gets each plain text or marker piece in
    order, on_end the end of the output; it answers through emit_content, emit_reasoning and emit_call."""

    markers: tuple[str, ...] = ()

    def __init__(self, content: TextChannel | None = None, reasoning: TextChannel | None = None):
        self._scanner = MarkerScanner(self.markers)
        self._content = content or TextChannel()
        self._reasoning = reasoning or TextChannel()
        self._deltas: list[Delta] = []
        self._calls = 0

    def on_piece(self, piece: Piece) -> None:
        raise NotImplementedError

    def on_end(self) -> None:
        """The output ended: what a subclass still holds goes out (as content when it is no complete call)."""

    def feed(self, text: str) -> list[Delta]:
        for piece in self._scanner.feed(text):
            self.on_piece(piece)
        return self._take()

    def finish(self) -> list[Delta]:
        for piece in self._scanner.finish():
            self.on_piece(piece)
        self.on_end()
        return self._take()

    def emit_content(self, text: str) -> None:
        if text := self._content.push(text):
            self._deltas.append(Delta(content=text))

    def emit_reasoning(self, text: str) -> None:
        if text := self._reasoning.push(text):
            self._deltas.append(Delta(reasoning=text))

    def emit_call(self, name: str, arguments: str) -> None:
        self._deltas.append(Delta(index=self._calls, id=new_call_id(), name=name, arguments=arguments))
        self._calls += 1

    def _take(self) -> list[Delta]:
        """The deltas made since the last feed, runs of content or of reasoning joined into one delta each."""
        out = []
        for kind, run in itertools.groupby(self._deltas, key=_text_kind):
            if kind is None:
                out.extend(run)
            else:
                out.append(Delta(**{kind: "".join(getattr(d, kind) for d in run)}))
        self._deltas = []
        return out


class BlockStream(MarkupStream):
    """Calls written one per block, between an open and a close marker, any number of blocks in a row.

    Outside a block, text is content and the `dropped` markers (those around a run of blocks) vanish. A block keeps
    its raw text until its close marker, which counts only outside a literal (a JSON string unless a subclass says
    otherwise through follow and in_literal); read_block then gives the block's call, or None to keep the raw
    block as content. An open marker outside a literal ends an unclosed block as content, as the end does.
    """

    open_marker: str
    close_marker: str
    dropped: tuple[str, ...] = ()

    def __init__(self):
        super().__init__()
        self._block: list[str] | None = None
        self.start_block()

    def read_block(self, body: str) -> tuple[str, str] | None:
        """(name, arguments) of the call whose text between the markers is body; None when it is no call."""
        raise NotImplementedError

    def start_block(self) -> None:
        self._json = JsonScanner()

    def follow(self, piece: Piece) -> None:
        """Takes in a piece of the open block's text."""
        self._json.skim(piece.text)

    def in_literal(self) -> bool:
        """Whether the open block's text so far ends inside a literal, where a marker is only text."""
        return self._json.in_string

    def on_piece(self, piece: Piece) -> None:
        if self._block is None:
            if piece.is_marker and piece.text == self.open_marker:
                self._open()
            elif not (piece.is_marker and piece.text in self.dropped):
                self.emit_content(piece.text)
            return
        if piece.is_marker and not self.in_literal():
            if piece.text == self.close_marker:
                self._close()
                return
            if piece.text == self.open_marker:
                self._give_up()
                self._open()
                return
        self._block.append(piece.text)
        self.follow(piece)

    def on_end(self) -> None:
        if self._block is not None:
            self._give_up()

    def _open(self) -> None:
        self._block = []
        self.start_block()

    def _close(self) -> None:
        body = "".join(self._block)
        self._block = None
        call = self.read_block(body)
        if call is None:
            self.emit_content(self.open_marker + body + self.close_marker)
        else:
            self.emit_call(*call)

    def _give_up(self) -> None:
        self.emit_content(self.open_marker + "".join(self._block))
        self._block = None
