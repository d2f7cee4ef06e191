"""The part of the text held back for a possible stop string: the longest end of the text that is a proper
beginning of some stop string, the same as the definition computed by brute force, for any text and stops."""

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmoe.engine.detokenizer import Detokenizer


def held_back(text: str, stops: list[str]) -> int:
    return max((n for s in stops for n in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:n])),
               default=0)


@settings(max_examples=300, deadline=None)
@given(st.text("abc", max_size=30), st.lists(st.text("abc", min_size=1, max_size=12), min_size=1, max_size=5))
def test_partial_stop_suffix_is_the_longest_proper_beginning_at_the_end(text, stops):
    d = Detokenizer.__new__(Detokenizer)
    d.text, d.stop = text, stops
    assert d._partial_stop_suffix() == held_back(text, stops)
