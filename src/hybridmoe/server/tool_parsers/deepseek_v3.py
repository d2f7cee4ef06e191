"""DeepSeek-V3, R1 and V3.1 tool calls: blocks inside a section,

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

and V3.1's shorter block `<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>`.
The section markers vanish; each block is one call, and an end marker inside a JSON string is part of the string.
"""

from __future__ import annotations

from hybridmoe.server.tool_parsers.base import BlockStream, ToolParser
from hybridmoe.server.tool_parsers.json_values import arguments_from_text, clean_name

SECTION_BEGIN, SECTION_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
SEPARATOR = "<｜tool▁sep｜>"
FENCE = "```"


def _fenced(text: str) -> str | None:
    """The text inside a ``` fence (its first line names the language), or None when text is not fenced."""
    text = text.strip()
    if len(text) < 2 * len(FENCE) or not text.startswith(FENCE) or not text.endswith(FENCE):
        return None
    _, newline, rest = text[:-len(FENCE)].partition("\n")
    return rest if newline else None


class DeepSeekV3Stream(BlockStream):
    markers = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, CALL_END)
    open_marker, close_marker = CALL_BEGIN, CALL_END
    dropped = (SECTION_BEGIN, SECTION_END)

    def read_block(self, body: str) -> tuple[str, str] | None:
        head, separator, tail = body.partition(SEPARATOR)
        if not separator:
            return None
        if head.strip() == "function":
            name_line, _, rest = tail.partition("\n")
            arguments_text = _fenced(rest)
            if arguments_text is not None:
                name, arguments = clean_name(name_line), arguments_from_text(arguments_text)
                if name is not None and arguments is not None:
                    return name, arguments
        name, arguments = clean_name(head), arguments_from_text(tail)
        return (name, arguments) if name is not None and arguments is not None else None


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    stream_class = DeepSeekV3Stream
