"""Mistral tool calls, in both layouts its tokenizers write:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]     a JSON list of calls
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}                                    one call per marker (v11 on)

The second layout may carry an id, NAME[CALL_ID]ID[ARGS]{...}, which is read past (calls get ids of their own).
No marker ends a call: it ends where its JSON value closes, so a bracket inside a JSON string belongs to the string.
"""

from __future__ import annotations

import enum

from hybridmoe.server.tool_parsers.base import MarkupStream, ToolParser
from hybridmoe.server.tool_parsers.json_values import arguments_from_text, clean_name, json_call, load_json
from hybridmoe.server.tool_parsers.scanning import JsonScanner, Piece, skip_space

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


class State(enum.Enum):
    OUTSIDE = enum.auto()
    OPENED = enum.auto()
    """Right after [TOOL_CALLS]: a JSON list (or object) or a name comes next."""
    NAME = enum.auto()
    BEFORE_ARGUMENTS = enum.auto()
    """After [ARGS], before the argument object's opening brace."""
    JSON_CALLS = enum.auto()
    ARGUMENTS = enum.auto()


JSON_STATES = (State.JSON_CALLS, State.ARGUMENTS)


def read_json_calls(text: str) -> list[tuple[str, str]] | None:
    """The calls of a JSON list of call objects (or of one call object); None unless every item is a call."""
    ok, value = load_json(text)
    items = value if isinstance(value, list) else [value]
    calls = [json_call(item) for item in items] if ok else []
    return calls if calls and None not in calls else None


class MistralStream(MarkupStream):
    markers = (TOOL_CALLS, ARGS, CALL_ID)

    def __init__(self):
        super().__init__()
        self._state = State.OUTSIDE
        self._raw: list[str] = []
        """The text from [TOOL_CALLS] on, content again when it turns out to be no call."""
        self._name: list[str] = []
        self._past_name = False
        self._value: list[str] = []
        self._json = JsonScanner()

    def on_piece(self, piece: Piece) -> None:
        inside_json = self._state in JSON_STATES and (piece.text != TOOL_CALLS or self._json.in_string)
        if not piece.is_marker or inside_json:
            self._text(piece.text)
        else:
            self._marker(piece.text)

    def on_end(self) -> None:
        if self._state is not State.OUTSIDE:
            self._give_up()

    def _marker(self, marker: str) -> None:
        if self._state is State.OUTSIDE:
            if marker == TOOL_CALLS:
                self._open()
            else:
                self.emit_content(marker)
        elif self._state in (State.OPENED, State.NAME) and marker in (ARGS, CALL_ID):
            self._raw.append(marker)
            if marker == ARGS:
                self._state = State.BEFORE_ARGUMENTS
            else:
                self._state, self._past_name = State.NAME, True
        else:
            self._give_up()
            self._marker(marker)

    def _text(self, text: str) -> None:
        i = 0
        while i < len(text):
            if self._state is State.OUTSIDE:
                self.emit_content(text[i:])
                return
            if self._state is State.NAME:
                if not self._past_name:
                    self._name.append(text[i:])
                self._raw.append(text[i:])
                return
            if self._state in JSON_STATES:
                i = self._read_value(text, i)
                continue
            start, i = i, skip_space(text, i)
            self._raw.append(text[start:i])
            if i < len(text):
                self._choose_layout(text[i])

    def _choose_layout(self, first: str) -> None:
        """Moves on by the first visible character after [TOOL_CALLS] or [ARGS]."""
        if self._state is State.OPENED and first in "[{":
            self._state, self._json, self._value = State.JSON_CALLS, JsonScanner(), []
        elif self._state is State.OPENED:
            self._state = State.NAME
        elif first == "{":
            self._state, self._json, self._value = State.ARGUMENTS, JsonScanner(), []
        else:
            self._give_up()

    def _read_value(self, text: str, start: int) -> int:
        """Reads the JSON value on from start; completes the call where it closes. Returns where reading stopped."""
        end = self._json.feed(text, start)
        stop = len(text) if end is None else end
        self._raw.append(text[start:stop])
        self._value.append(text[start:stop])
        if end is not None:
            self._complete()
        return stop

    def _complete(self) -> None:
        value = "".join(self._value)
        if self._state is State.JSON_CALLS:
            calls = read_json_calls(value)
        else:
            name, arguments = clean_name("".join(self._name)), arguments_from_text(value)
            calls = [(name, arguments)] if name is not None and arguments is not None else None
        if calls is None:
            self._give_up()
            return
        for name, arguments in calls:
            self.emit_call(name, arguments)
        self._state = State.OUTSIDE

    def _open(self) -> None:
        self._state, self._raw, self._name, self._past_name = State.OPENED, [TOOL_CALLS], [], False

    def _give_up(self) -> None:
        self._state = State.OUTSIDE
        self.emit_content("".join(self._raw))


class MistralToolParser(ToolParser):
    name = "mistral"
    stream_class = MistralStream
