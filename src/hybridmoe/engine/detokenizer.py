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
        """Length of the longest end of text that is a proper beginning of a stop string. Per stop string s
        it compares at most len(s) ends of text, each at most len(s) characters, only from where text holds
        s's first character."""
        best = 0
        for s in self.stop:
            tail = self.text[len(self.text) - min(len(s) - 1, len(self.text)):]
            i = tail.find(s[0])
            while 0 <= i < len(tail) - best:  # ends of tail, longest first, longer than best
                if s.startswith(tail[i:]):
                    best = len(tail) - i
                    break
                i = tail.find(s[0], i + 1)
        return best
