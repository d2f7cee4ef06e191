"""MiniMax-M2 tool calls: XML-like invocations inside a <minimax:tool_call> section,

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">3</parameter>
    </invoke>
    </minimax:tool_call>

The section markers vanish; each <invoke> is one call. A parameter's value that reads as JSON (a number, true, an
object, ...) is kept as that JSON value, any other as a string, as the chat template writes strings bare and
everything else as JSON. A value may hold any text but `</parameter>`, an `</invoke>` included. Names may be
written with or without quotes.
"""

from __future__ import annotations

from hybridmoe.server.tool_parsers.base import BlockStream, ToolParser
from hybridmoe.server.tool_parsers.json_values import call_arguments, clean_name, load_json
from hybridmoe.server.tool_parsers.scanning import Piece, skip_space

SECTION_MARKERS = ("<minimax:tool_call>", "</minimax:tool_call>")
INVOKE_OPEN, INVOKE_CLOSE = "<invoke name=", "</invoke>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter name=", "</parameter>"


def _name_and_rest(text: str) -> tuple[str, str] | None:
    """The name up to the tag's closing '>' (quotes taken off) and the text after it; None without a '>'."""
    head, bracket, rest = text.partition(">")
    if not bracket:
        return None
    name = clean_name(head.strip().strip("\"'"))
    return None if name is None else (name, rest)


def _value(text: str):
    """A parameter's value: the JSON it reads as, else the text without the newlines that frame it."""
    ok, value = load_json(text)
    return value if ok else text.strip("\n")


def read_invoke(body: str) -> tuple[str, str] | None:
    """(name, arguments) of the text between `<invoke name=` and `</invoke>`; None when its layout is another."""
    head = _name_and_rest(body)
    if head is None:
        return None
    name, rest = head
    arguments, i = {}, 0
    while (i := skip_space(rest, i)) < len(rest):
        if not rest.startswith(PARAMETER_OPEN, i):
            return None
        end = rest.find(PARAMETER_CLOSE, i)
        parameter = end >= 0 and _name_and_rest(rest[i + len(PARAMETER_OPEN):end])
        if not parameter:
            return None
        arguments[parameter[0]] = _value(parameter[1])
        i = end + len(PARAMETER_CLOSE)
    arguments_text = call_arguments(arguments)
    return None if arguments_text is None else (name, arguments_text)


class MiniMaxM2Stream(BlockStream):
    markers = (*SECTION_MARKERS, INVOKE_OPEN, INVOKE_CLOSE, PARAMETER_OPEN, PARAMETER_CLOSE)
    open_marker, close_marker = INVOKE_OPEN, INVOKE_CLOSE
    dropped = SECTION_MARKERS

    def start_block(self) -> None:
        self._in_value = False

    def follow(self, piece: Piece) -> None:
        if piece.is_marker and piece.text in (PARAMETER_OPEN, PARAMETER_CLOSE):
            self._in_value = piece.text == PARAMETER_OPEN

    def in_literal(self) -> bool:
        return self._in_value

    def read_block(self, body: str) -> tuple[str, str] | None:
        return read_invoke(body)


class MiniMaxM2ToolParser(ToolParser):
    name = "minimax_m2"
    stream_class = MiniMaxM2Stream
