"""Cutting streamed text into markers and plain text (MarkerScanner), finding where a JSON value ends in text that
arrives in pieces (JsonScanner), and a channel of text that trims its ends (TextChannel): the pieces every format's
stream is built from. Each piece of text is read a bounded number of times."""

from __future__ import annotations

import functools
import itertools
import re
from typing import NamedTuple


def skip_space(text: str, start: int) -> int:
    """The index of the first character at or after start that is not whitespace (len(text) when none is)."""
    while start < len(text) and text[start].isspace():
        start += 1
    return start


class Piece(NamedTuple):
    text: str
    is_marker: bool


@functools.cache
def _marker_tables(markers: tuple[str, ...]) -> tuple[re.Pattern, frozenset[str], frozenset[str]]:
    """The pattern finding any marker (longest first at one position), every proper prefix of a marker, and the
    markers that are the prefix of a longer one."""
    for a, b in itertools.permutations(markers, 2):
        if a in b[1:]:
            raise ValueError(f"marker {a!r} stands inside marker {b!r}; a scanner cannot tell them apart")
    pattern = re.compile("|".join(re.escape(m) for m in sorted(markers, key=len, reverse=True)))
    prefixes = frozenset(m[:k] for m in markers for k in range(1, len(m)))
    extendable = frozenset(m for m in markers if any(o != m and o.startswith(m) for o in markers))
    return pattern, prefixes, extendable


class MarkerScanner:
    """Cuts streamed text into plain text and markers, holding back only a tail that may begin a marker."""

    def __init__(self, markers: tuple[str, ...]):
        self._markers = markers
        self._pattern, self._prefixes, self._extendable = _marker_tables(tuple(markers))
        self._longest = max(map(len, markers), default=0)
        self._held = ""

    def feed(self, text: str) -> list[Piece]:
        return self._scan(self._held + text, final=False)

    def finish(self) -> list[Piece]:
        """The held tail, read as the end of the text."""
        return self._scan(self._held, final=True)

    def _scan(self, text: str, final: bool) -> list[Piece]:
        pieces, done, stop = [], 0, len(text)
        for found in self._pattern.finditer(text) if self._markers else ():
            if not final and self._may_grow(text, found):
                stop = found.start()
                break
            if found.start() > done:
                pieces.append(Piece(text[done:found.start()], False))
            pieces.append(Piece(found.group(), True))
            done = found.end()
        else:
            if not final:
                stop = len(text) - self._marker_start_length(text, done)
        if stop > done:
            pieces.append(Piece(text[done:stop], False))
        self._held = text[stop:]
        return pieces

    def _may_grow(self, text: str, found: re.Match) -> bool:
        """Whether the marker found at the end of the text may be the start of a longer marker still arriving."""
        rest = text[found.start():]
        return found.group() in self._extendable and len(rest) < self._longest and rest in self._prefixes

    def _marker_start_length(self, text: str, done: int) -> int:
        """The length of the longest tail of text[done:] that is a proper prefix of a marker."""
        for length in range(min(self._longest - 1, len(text) - done), 0, -1):
            if text[len(text) - length:] in self._prefixes:
                return length
        return 0


_STRING_STOPS = re.compile(r'["\\]')
_VALUE_STOPS = re.compile(r'["\[\]{}]')


class JsonScanner:
    """Follows streamed JSON text only as far as a stream needs: whether it is inside a string literal (a marker
    written there is text), and how deep in brackets (where a value written without an end marker ends)."""

    def __init__(self):
        self.in_string = False
        self.depth = 0
        self._escaped = False
        """The previous text ended in a backslash inside a string, so the next character is escaped."""

    def feed(self, text: str, start: int = 0) -> int | None:
        """Reads text from start up to the bracket that closes the outermost open one, and returns the index just
        past it; reads all of it and returns None when no bracket closes to depth 0."""
        i, n = start, len(text)
        if self._escaped and i < n:
            self._escaped, i = False, i + 1
        while i < n:
            if self.in_string:
                stop = _STRING_STOPS.search(text, i)
                if stop is None:
                    return None
                i = stop.end()
                if stop.group() == '"':
                    self.in_string = False
                elif i < n:
                    i += 1
                else:
                    self._escaped = True
                continue
            stop = _VALUE_STOPS.search(text, i)
            if stop is None:
                return None
            i, char = stop.end(), stop.group()
            if char == '"':
                self.in_string = True
            elif char in "[{":
                self.depth += 1
            elif self.depth:
                self.depth -= 1
                if not self.depth:
                    return i
        return None

    def skim(self, text: str) -> None:
        """Reads all of text, past any value that closes in it."""
        start = 0
        while (start := self.feed(text, start)) is not None:
            pass


class TextChannel:
    """What of one kind of streamed text (content or reasoning) goes out now.

    Whitespace before the first visible character waits for one, so a text of whitespace only never goes out;
    trim_start drops that whitespace instead, and trim_end holds each run of whitespace until a visible character
    follows it, so the text ends at its last visible one."""

    def __init__(self, trim_start: bool = False, trim_end: bool = False):
        self.trim_start, self.trim_end = trim_start, trim_end
        self._started = False
        self._waiting: list[str] = []

    def push(self, text: str) -> str:
        if not self._started:
            visible = text.lstrip()
            if not visible:
                if not self.trim_start:
                    self._waiting.append(text)
                return ""
            self._started = True
            if self.trim_start:
                text = visible
        if self.trim_end:
            through_last_visible = text.rstrip()
            if not through_last_visible:
                self._waiting.append(text)
                return ""
            out = "".join(self._waiting) + through_last_visible
            self._waiting = [text[len(through_last_visible):]]
            return out
        if self._waiting:
            text = "".join(self._waiting) + text
            self._waiting = []
        return text
