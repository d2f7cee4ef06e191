"""An answer's deltas (chat_output's: reasoning, text and pieces of tool calls) as Anthropic's content blocks:
whole for /v1/messages, and as content_block_start, content_block_delta and content_block_stop events when
streamed. Both come out of one reader, ContentBlocks, so a streamed answer's blocks are those of the same answer
answered whole.

A block is a run of one kind in the output's order: the reasoning a thinking block, the answer's text a text
block, each call a tool_use block (text between two calls is a text block of its own). A text or thinking block
opens at its first visible character: whitespace before it waits, and is dropped when something else comes first
or the output ends (Anthropic refuses a whitespace-only text block sent back to it).
"""

from __future__ import annotations

import json

from hybridmoe.server.anthropic_protocol import (
    ResponseBlock,
    TextContent,
    ThinkingContent,
    ToolUseContent,
)
from hybridmoe.server.chat_output import ChatOutputFormat
from hybridmoe.server.tool_parsers import Delta, new_call_id

TOOL_USE_ID_PREFIX = "toolu_"
CALL_ID_PREFIX = "call_"
"""How new_call_id's ids begin: the rest is the random part a tool_use id keeps."""

TEXT_DELTAS = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking")}
"""A text kind's delta type and the field its text travels in (the same field as in its block)."""


def tool_use_id(call_id: str | None) -> str:
    """Anthropic's id of a call: "toolu_" and the random part of the call's id (of a fresh one where the call's
    id is not new_call_id's)."""
    if not (call_id or "").startswith(CALL_ID_PREFIX) or len(call_id) == len(CALL_ID_PREFIX):
        call_id = new_call_id()
    return TOOL_USE_ID_PREFIX + call_id[len(CALL_ID_PREFIX):]


class ContentBlocks:
    """Reads one answer's deltas in order: feed() and finish() return the stream's block events, `blocks` holds the
    blocks so far. With parallel false only the first call is kept (disable_parallel_tool_use)."""

    def __init__(self, parallel: bool = True):
        self.blocks: list[ResponseBlock] = []
        self._parallel = parallel
        self._open: str | int | None = None
        """The open block: "text", "thinking", a call's index, or None."""
        self._waiting: tuple[str, str] | None = None
        """(kind, whitespace) read before a block of that kind opens."""
        self._arguments: list[str] = []
        """The open call's arguments so far."""

    @property
    def called(self) -> bool:
        return any(isinstance(b, ToolUseContent) for b in self.blocks)

    def feed(self, deltas: list[Delta]) -> list[dict]:
        events = []
        for d in deltas:
            kind = d.index if d.index is not None else "thinking" if d.reasoning else "text" if d.content else None
            if kind is None:
                continue
            if self._waiting is not None and self._waiting[0] != kind:
                self._waiting = None
            events += self._call(d) if d.index is not None else self._text(kind, d.reasoning or d.content)
        return events

    def finish(self) -> list[dict]:
        """The output ended: the open block's stop."""
        self._waiting = None
        return self._close()

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self._open != kind:
            text = (self._waiting[1] if self._waiting is not None else "") + text
            if not text.strip():
                self._waiting = (kind, text)
                return []
            self._waiting = None
            events = self._close() + self._start(TextContent(text="") if kind == "text" else ThinkingContent(
                thinking=""), kind)
        block, (delta_type, field) = self.blocks[-1], TEXT_DELTAS[kind]
        setattr(block, field, getattr(block, field) + text)
        return events + [{"type": "content_block_delta", "index": len(self.blocks) - 1,
                          "delta": {"type": delta_type, field: text}}]

    def _call(self, d: Delta) -> list[dict]:
        if not self._parallel and d.index != 0:
            return []
        events = []
        if self._open != d.index:
            events = self._close() + self._start(ToolUseContent(id=tool_use_id(d.id), name=d.name or "", input={}),
                                                 d.index)
        if d.arguments:
            self._arguments.append(d.arguments)
            events.append({"type": "content_block_delta", "index": len(self.blocks) - 1,
                           "delta": {"type": "input_json_delta", "partial_json": d.arguments}})
        return events

    def _start(self, block: ResponseBlock, kind: str | int) -> list[dict]:
        self.blocks.append(block)
        self._open = kind
        return [{"type": "content_block_start", "index": len(self.blocks) - 1,
                 "content_block": block.model_dump(mode="json")}]

    def _close(self) -> list[dict]:
        if self._open is None:
            return []
        block = self.blocks[-1]
        if isinstance(block, ToolUseContent):
            block.input = _input("".join(self._arguments))
            self._arguments = []
        self._open = None
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]


def _input(arguments: str) -> dict:
    """A call's input: its arguments, compact JSON of an object as the parsers write them."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def answer_blocks(output: ChatOutputFormat, text: str, parallel: bool) -> ContentBlocks:
    """A whole answer's blocks, read as its stream is."""
    reader, blocks = output.stream(), ContentBlocks(parallel)
    blocks.feed(reader.feed(text) + reader.finish())
    blocks.finish()
    return blocks
