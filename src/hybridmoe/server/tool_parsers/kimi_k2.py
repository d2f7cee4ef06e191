"""Kimi-K2 tool calls: blocks inside a section, each naming its call as functions.NAME:INDEX,

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

The section markers (also in the singular spelling the model sometimes writes) vanish; an end marker inside a JSON
string is part of the string.
"""

from __future__ import annotations

from hybridmoe.server.tool_parsers.base import BlockStream, ToolParser
from hybridmoe.server.tool_parsers.json_values import arguments_from_text, clean_name

SECTION_MARKERS = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                   "<|tool_call_section_begin|>", "<|tool_call_section_end|>")
CALL_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_end|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"


def function_name(call_id: str) -> str | None:
    """get_weather from the call id functions.get_weather:0 (the prefix and the index are optional)."""
    name = call_id.strip().removeprefix("functions.")
    head, colon, index = name.rpartition(":")
    return clean_name(head if colon and index.isdigit() else name)


class KimiK2Stream(BlockStream):
    markers = (*SECTION_MARKERS, CALL_BEGIN, CALL_END)
    open_marker, close_marker = CALL_BEGIN, CALL_END
    dropped = SECTION_MARKERS

    def read_block(self, body: str) -> tuple[str, str] | None:
        call_id, separator, arguments_text = body.partition(ARGUMENT_BEGIN)
        if not separator:
            return None
        name, arguments = function_name(call_id), arguments_from_text(arguments_text)
        return (name, arguments) if name is not None and arguments is not None else None


class KimiK2ToolParser(ToolParser):
    name = "kimi_k2"
    stream_class = KimiK2Stream
