"""Incremental detokenization with stop strings.

Text is released as it becomes final: never half a UTF-8 character (a byte-level token can end
mid-character, which decodes to U+FFFD until the next token completes it), never text past a
stop string, and never the start of what may still turn into a stop string. So the deltas of a
stream add up to exactly the final text.
"""

from __future__ import annotations

from hybridmoe.tokenizer import Tokenizer

# Tokens of the prompt decoded together with the first new ones, so that decoders which treat
# the first token specially (SentencePiece's leading space) see the same text as in context.
_CONTEXT_TOKENS = 5


class _PrefixTracker:
    """For each stop string s, the longest beginning of s that the text ends with, kept as the text grows (a
    KMP automaton per stop string: each new character costs each stop string amortized O(1))."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.fail = [_failure(s) for s in stops]
        self.state = [0] * len(stops)

    def feed(self, text: str) -> None:
        for k, (s, fail) in enumerate(zip(self.stops, self.fail)):
            m = self.state[k]
            for c in text:
                while m and s[m] != c:
                    m = fail[m - 1]
                if s[m] == c:
                    m += 1
                if m == len(s):  # a whole stop string (the detokenizer cuts there): keep its longest border
                    m = fail[m - 1]
            self.state[k] = m

    def longest(self) -> int:
        return max(self.state, default=0)


def _failure(s: str) -> list[int]:
    """KMP failure function: fail[i] = length of the longest proper border of s[:i + 1]."""
    fail, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        # ids[prefix:read] decode to text already taken; ids[prefix:] is what is decoded next.
        self.prefix = 0
        self.read = len(self.ids)
        self.text = ""
        """Decoded output text so far, cut before a stop string once one is found."""
        self.emitted = 0
        """Characters of text already handed out."""
        self._prefixes = _PrefixTracker(stop)

    def add(self, token_id: int | None, final: bool) -> tuple[str, bool]:
        """Take one new token (None: nothing to decode, e.g. an EOS); return (text delta, stopped).

        final: no more tokens will come, so nothing is held back for a possible stop string.
        """
        if token_id is not None:
            self.ids.append(token_id)
            prefix_text = self._decode(self.ids[self.prefix:self.read])
            full_text = self._decode(self.ids[self.prefix:])
            if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
                old_len = len(self.text)
                self.text += full_text[len(prefix_text):]
                self._prefixes.feed(full_text[len(prefix_text):])
                self.prefix, self.read = self.read, len(self.ids)
                cut = self._find_stop(max(0, old_len - self._longest_stop() + 1))
                if cut is not None:
                    self.text = self.text[:cut]
                    return self._release(len(self.text)), True
        end = len(self.text) if final else len(self.text) - self._partial_stop_suffix()
        return self._release(end), False

    @property
    def emitted_text(self) -> str:
        return self.text[:self.emitted]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _release(self, end: int) -> str:
        end = max(end, self.emitted)
        delta, self.emitted = self.text[self.emitted:end], end
        return delta

    def _longest_stop(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def _find_stop(self, start: int) -> int | None:
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _partial_stop_suffix(self) -> int:
        """Length of the longest end of text that is a proper beginning of a stop string (kept up to date as
        text grows, in time proportional to the new characters)."""
        return self._prefixes.longest()
