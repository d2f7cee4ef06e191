"""The part of the text held back for a possible stop string: the longest end of the text that is a proper
beginning of some stop string, kept as the text grows, the same as the definition computed by brute force,
for any text (fed in any pieces) and stops."""

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmoe.engine.detokenizer import _PrefixTracker


def held_back(text: str, stops: list[str]) -> int:
    return max((n for s in stops for n in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:n])),
               default=0)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text("abc", max_size=6), max_size=8),
       st.lists(st.text("abc", min_size=1, max_size=12), min_size=1, max_size=5))
def test_the_tracked_beginning_is_the_longest_proper_beginning_at_the_end(pieces, stops):
    tracker, text = _PrefixTracker(stops), ""
    for piece in pieces:
        tracker.feed(piece)
        text += piece
        if not any(s in text for s in stops):  # the detokenizer cuts the text at a stop string and ends
            assert tracker.longest() == held_back(text, stops)
