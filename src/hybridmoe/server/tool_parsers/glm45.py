"""GLM-4.5 tool calls: the name, then each argument as a key and a value,

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

A value that reads as JSON (a number, true, an object, ...) is kept as that JSON value, any other as a string,
as the chat template writes strings bare and everything else as JSON. A value may hold any text but
`</arg_value>`, a `</tool_call>` included.
"""

from __future__ import annotations

from hybridmoe.server.tool_parsers.base import BlockStream, ToolParser
from hybridmoe.server.tool_parsers.json_values import call_arguments, clean_name, load_json
from hybridmoe.server.tool_parsers.scanning import Piece, skip_space

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY_OPEN, KEY_CLOSE = "<arg_key>", "</arg_key>"
VALUE_OPEN, VALUE_CLOSE = "<arg_value>", "</arg_value>"


def _value(text: str):
    ok, value = load_json(text)
    return value if ok else text


def _tag(text: str, start: int, open_tag: str, close_tag: str) -> tuple[str, int] | None:
    """(inner text, index past the close tag) of the tag pair that opens at start after whitespace, or None."""
    start = skip_space(text, start)
    if not text.startswith(open_tag, start):
        return None
    end = text.find(close_tag, start + len(open_tag))
    return None if end < 0 else (text[start + len(open_tag):end], end + len(close_tag))


def read_call(body: str) -> tuple[str, str] | None:
    """(name, arguments) of a call's text between <tool_call> and </tool_call>; None when its layout is another."""
    first_key = body.find(KEY_OPEN)
    name = clean_name(body if first_key < 0 else body[:first_key])
    if name is None:
        return None
    arguments, i = {}, len(body) if first_key < 0 else first_key
    while (i := skip_space(body, i)) < len(body):
        key = _tag(body, i, KEY_OPEN, KEY_CLOSE)
        value = key and _tag(body, key[1], VALUE_OPEN, VALUE_CLOSE)
        if not value:
            return None
        arguments[key[0].strip()] = _value(value[0])
        i = value[1]
    arguments_text = call_arguments(arguments)
    return None if arguments_text is None else (name, arguments_text)


class Glm45Stream(BlockStream):
    markers = (OPEN, CLOSE, VALUE_OPEN, VALUE_CLOSE)
    open_marker, close_marker = OPEN, CLOSE

    def start_block(self) -> None:
        self._in_value = False

    def follow(self, piece: Piece) -> None:
        if piece.is_marker and piece.text in (VALUE_OPEN, VALUE_CLOSE):
            self._in_value = piece.text == VALUE_OPEN

    def in_literal(self) -> bool:
        return self._in_value

    def read_block(self, body: str) -> tuple[str, str] | None:
        return read_call(body)


class Glm45ToolParser(ToolParser):
    name = "glm45"
    stream_class = Glm45Stream
