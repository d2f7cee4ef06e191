"""A chat choice's generated text as the response carries it: the reasoning (reasoning_content), the answer
(content) and the tool calls (tool_calls), whole or streamed.

The reasoning is split off first (reasoning.py), then the answer's tool calls are parsed in the model's format
(tool_parsers/); a streamed choice goes through the same two readers piece by piece, so its deltas assemble to
what the whole text parses to.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridmoe.server.protocol import DeltaMessage, FunctionCallOut, FunctionDelta, ToolCallDelta, ToolCallOut
from hybridmoe.server.reasoning import ReasoningParser
from hybridmoe.server.tool_parsers.base import Delta, ParsedOutput, ToolCall, ToolParser, ToolStream


@dataclass(frozen=True)
class ChatOutputFormat:
    """How one request's choices are read: its tool-call parser (None: the text is the answer, tool calls and
    all) and its reasoning parser (None: no reasoning is split off)."""

    tools: ToolParser | None = None
    reasoning: ReasoningParser | None = None

    def parse(self, text: str) -> ParsedOutput:
        """The whole text of a choice."""
        reasoning, answer = (None, text) if self.reasoning is None else self.reasoning.parse(text)
        if self.tools is None:
            return ParsedOutput(content=answer if self.reasoning is None else answer or "", tool_calls=[],
                                reasoning=reasoning)
        parsed = self.tools.parse(answer or "")
        parsed.reasoning = _joined(reasoning, parsed.reasoning)
        return parsed

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


class ChoiceStream:
    """One streamed choice: feed() each new piece of text, finish() at the end; both give the deltas to send."""

    def __init__(self, output_format: ChatOutputFormat):
        self._reasoning = output_format.reasoning.stream() if output_format.reasoning is not None else None
        self._tools: ToolStream | None = output_format.tools.stream() if output_format.tools is not None else None

    def feed(self, text: str) -> list[Delta]:
        if self._reasoning is None:
            return self._answer([Delta(content=text)] if text else [])
        return self._answer(self._reasoning.feed(text))

    def _answer(self, deltas: list[Delta]) -> list[Delta]:
        """Reasoning deltas as they are; the answer's text through the tool-call reader."""
        if self._tools is None:
            return deltas
        out = []
        for d in deltas:
            if d.content:
                out += _name_first(self._tools.feed(d.content))
            elif d.reasoning:
                out.append(d)
        return out

    def finish(self) -> list[Delta]:
        deltas = self._answer(self._reasoning.finish()) if self._reasoning is not None else []
        return deltas + (_name_first(self._tools.finish()) if self._tools is not None else [])


def _name_first(deltas: list[Delta]) -> list[Delta]:
    """A call's first delta split in two, as OpenAI streams calls: its id and name, then its arguments."""
    out = []
    for d in deltas:
        if d.name is not None and d.arguments:
            out += [Delta(index=d.index, id=d.id, name=d.name, arguments=""), Delta(index=d.index,
                                                                                   arguments=d.arguments)]
        else:
            out.append(d)
    return out


def tool_calls_out(calls: list[ToolCall]) -> list[ToolCallOut] | None:
    """A message's tool_calls (None when there are none, as OpenAI leaves the field out)."""
    return [ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in calls] or None


def delta_message(d: Delta) -> DeltaMessage:
    """A streamed Delta as OpenAI's chunk delta: content, reasoning_content or one tool_calls entry."""
    if d.index is None:
        return DeltaMessage(content=d.content, reasoning_content=d.reasoning)
    function = FunctionDelta(name=d.name, arguments=d.arguments)
    return DeltaMessage(tool_calls=[ToolCallDelta(index=d.index, id=d.id, type="function" if d.id else None,
                                                  function=function)])


def _joined(a: str | None, b: str | None) -> str | None:
    return "\n".join(x for x in (a, b) if x) or None
