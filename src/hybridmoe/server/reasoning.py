"""Reasoning split from the answer, for the models that think between <think> and </think> (Qwen3, DeepSeek-R1,
DeepSeek-V3.1, GLM-4.5).

A chat template may open <think> in the prompt itself, so the output starts inside the reasoning and shows only
</think>: ReasoningParser(starts_in_reasoning=True). Otherwise a <think> before any visible text opens it. An
output that never closes its reasoning is reasoning throughout (the model ran out of tokens while thinking). The
reasoning is kept without its surrounding whitespace and the answer without the whitespace that leads it (the
templates write newlines around both); a <think> or </think> in the answer is its text.

gpt-oss marks reasoning as its analysis channel instead, which the harmony tool parser reads.
"""

from __future__ import annotations

import enum

from hybridmoe.server.tool_parsers.base import MarkupStream, assemble
from hybridmoe.server.tool_parsers.scanning import Piece, TextChannel

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class Phase(enum.Enum):
    START = enum.auto()
    """Nothing visible yet: a <think> now opens the reasoning."""
    REASONING = enum.auto()
    ANSWER = enum.auto()


class ReasoningStream(MarkupStream):
    markers = (THINK_OPEN, THINK_CLOSE)

    def __init__(self, starts_in_reasoning: bool):
        super().__init__(content=TextChannel(trim_start=True), reasoning=TextChannel(trim_start=True, trim_end=True))
        self._phase = Phase.REASONING if starts_in_reasoning else Phase.START
        self._reasoning_seen = False
        """Whether the reasoning has had a visible character (before one, a <think> is the template's again)."""

    def on_piece(self, piece: Piece) -> None:
        if self._phase is Phase.REASONING:
            self._reasoning_piece(piece)
        elif self._phase is Phase.ANSWER:
            self.emit_content(piece.text)
        elif piece.is_marker:
            self._phase = Phase.REASONING if piece.text == THINK_OPEN else Phase.ANSWER
        else:
            if piece.text.strip():
                self._phase = Phase.ANSWER
            self.emit_content(piece.text)

    def _reasoning_piece(self, piece: Piece) -> None:
        if piece.is_marker and piece.text == THINK_CLOSE:
            self._phase = Phase.ANSWER
        elif not (piece.is_marker and not self._reasoning_seen):
            self._reasoning_seen = self._reasoning_seen or bool(piece.text.strip())
            self.emit_reasoning(piece.text)


class ReasoningParser:
    """Splits one model's output into (reasoning, answer), whole (parse) or streamed (stream)."""

    def __init__(self, starts_in_reasoning: bool):
        self.starts_in_reasoning = starts_in_reasoning

    def stream(self) -> ReasoningStream:
        """A fresh reader for one choice: feed and finish give Delta(reasoning=...) and Delta(content=...)."""
        return ReasoningStream(self.starts_in_reasoning)

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content), each None when empty."""
        reader = self.stream()
        parsed = assemble(reader.feed(text) + reader.finish())
        return parsed.reasoning, parsed.content


def template_thinks(chat_template: str | None) -> bool:
    """Whether the model's chat template writes <think> (its outputs may reason)."""
    return bool(chat_template) and THINK_OPEN in chat_template


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an open <think>, so the output starts in the reasoning (the prompt,
    not the template, tells: a request switches thinking on or off through it, enable_thinking, thinking)."""
    return prompt.rstrip().endswith(THINK_OPEN)


def reasoning_parser(chat_template: str | None, prompt: str) -> ReasoningParser | None:
    """The reasoning parser of one request: None when the model's template does not think; the output starts in
    the reasoning when the rendered prompt opens it."""
    if not template_thinks(chat_template):
        return None
    return ReasoningParser(starts_in_reasoning=prompt_opens_reasoning(prompt))
