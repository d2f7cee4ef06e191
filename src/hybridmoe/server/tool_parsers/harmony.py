"""gpt-oss's harmony format: the output is a run of messages, each a header and a body,

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Rome"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

The analysis channel is reasoning; a message to=functions.NAME (the recipient may also stand before the channel)
is a call of NAME with its body as arguments; any other message is content. <|call|> and <|return|> end the
output as stop tokens, so the server may have cut them off: the end of the output ends a call as <|call|> does.
Reasoning and content stream as they come; a call goes out whole when its message ends. A message whose header is
cut off, a call whose arguments are not a JSON object, or a message to another recipient stays content as it was
written. A marker inside a JSON string of a call's arguments is part of the string.
"""

from __future__ import annotations

import enum
import re

from hybridmoe.server.tool_parsers.base import MarkupStream, ToolParser
from hybridmoe.server.tool_parsers.json_values import arguments_from_text, clean_name
from hybridmoe.server.tool_parsers.scanning import JsonScanner, Piece

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
MESSAGE_ENDS = (END, CALL, RETURN)
HEADER_OPENERS = (START, CHANNEL)
FUNCTIONS = "functions."

_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")


class Kind(enum.Enum):
    REASONING = enum.auto()
    CONTENT = enum.auto()
    CALL = enum.auto()
    RAW = enum.auto()
    """A message to a recipient other than a function: kept as written."""


def classify(header: str) -> tuple[Kind, str | None]:
    """What a message with this header is, and for a call the function's name."""
    recipient = _RECIPIENT.search(header)
    if recipient is not None:
        name = clean_name(recipient.group(1).removeprefix(FUNCTIONS))
        is_function = recipient.group(1).startswith(FUNCTIONS) and name is not None
        return (Kind.CALL, name) if is_function else (Kind.RAW, None)
    channel = _CHANNEL_NAME.search(header)
    return (Kind.REASONING if channel is not None and channel.group(1) == "analysis" else Kind.CONTENT), None


class HarmonyStream(MarkupStream):
    markers = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)

    def __init__(self):
        super().__init__()
        self._header: list[str] | None = None
        """The header's raw text while one is open."""
        self._kind: Kind | None = None
        """The open message body's kind; None outside a body."""
        self._name: str | None = None
        self._raw: list[str] = []
        """A call's or a RAW message's text from its header on, content again if it is no call."""
        self._arguments: list[str] = []
        self._json = JsonScanner()

    def on_piece(self, piece: Piece) -> None:
        if self._kind is not None:
            self._body_piece(piece)
        elif self._header is not None:
            self._header_piece(piece)
        elif piece.is_marker and piece.text in HEADER_OPENERS:
            self._header = [piece.text]
        elif piece.is_marker and piece.text == MESSAGE:
            self._header = []
            self._open_body()
        elif not (piece.is_marker and piece.text in MESSAGE_ENDS):
            self.emit_content(piece.text)

    def on_end(self) -> None:
        if self._kind is not None:
            self._close_body("")
        elif self._header is not None:
            self.emit_content("".join(self._header))
            self._header = None

    def _header_piece(self, piece: Piece) -> None:
        if piece.is_marker and piece.text == MESSAGE:
            self._open_body()
        elif piece.is_marker and piece.text not in (CHANNEL, CONSTRAIN):
            self.emit_content("".join(self._header))
            self._header = None
            self.on_piece(piece)
        else:
            self._header.append(piece.text)

    def _open_body(self) -> None:
        header = "".join(self._header)
        self._kind, self._name = classify(header)
        self._raw, self._arguments, self._json = [header, MESSAGE], [], JsonScanner()
        self._header = None

    def _body_piece(self, piece: Piece) -> None:
        is_boundary = piece.is_marker and piece.text in MESSAGE_ENDS + HEADER_OPENERS
        if is_boundary and not (self._kind is Kind.CALL and self._json.in_string):
            self._close_body(piece.text if piece.text in MESSAGE_ENDS else "")
            if piece.text in HEADER_OPENERS:
                self._header = [piece.text]
        elif self._kind is Kind.REASONING:
            self.emit_reasoning(piece.text)
        elif self._kind is Kind.CONTENT:
            self.emit_content(piece.text)
        else:
            self._raw.append(piece.text)
            self._arguments.append(piece.text)
            self._json.skim(piece.text)

    def _close_body(self, end_marker: str) -> None:
        kind, self._kind = self._kind, None
        if kind is Kind.CALL:
            arguments = arguments_from_text("".join(self._arguments))
            if arguments is not None:
                self.emit_call(self._name, arguments)
                return
        if kind in (Kind.CALL, Kind.RAW):
            self.emit_content("".join(self._raw) + end_marker)


class HarmonyToolParser(ToolParser):
    name = "harmony"
    stream_class = HarmonyStream
