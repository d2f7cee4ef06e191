"""Hermes-style tool calls, as Qwen2, Qwen2.5 and Qwen3 write them: one JSON object per block,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

any number of blocks in a row. A `</tool_call>` inside a JSON string is part of the string.
"""

from __future__ import annotations

from hybridmoe.server.tool_parsers.base import BlockStream, ToolParser
from hybridmoe.server.tool_parsers.json_values import json_call, load_json

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesStream(BlockStream):
    markers = (OPEN, CLOSE)
    open_marker, close_marker = OPEN, CLOSE

    def read_block(self, body: str) -> tuple[str, str] | None:
        ok, value = load_json(body)
        return json_call(value) if ok else None


class HermesToolParser(ToolParser):
    name = "hermes"
    stream_class = HermesStream
