"""An answer's deltas as Anthropic's content blocks: whole and streamed in any pieces they give the same blocks
(the events, replayed as Anthropic's client replays them, too), in the output's order, without whitespace-only
text blocks, and with one call only when parallel calls are off."""

import itertools
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmoe.server.anthropic_blocks import ContentBlocks, answer_blocks, tool_use_id
from hybridmoe.server.chat_output import ChatOutputFormat
from hybridmoe.server.reasoning import reasoning_parser
from hybridmoe.server.tool_parsers import parser_for_template

QWEN_TEMPLATE = "... <tool_call> ... <think> ..."
TEXT = ('<think>\nThe user wants weather.\n</think>\n\nLet me look.\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
        '</tool_call>')
FORMAT = ChatOutputFormat(parser_for_template(QWEN_TEMPLATE), reasoning_parser(QWEN_TEMPLATE, "prompt"))


def _without_ids(blocks) -> list[dict]:
    return [{k: v for k, v in b.model_dump().items() if k != "id"} for b in blocks]


def _replayed(events: list[dict]) -> list[dict]:
    """The blocks the events build, as Anthropic's client builds them (a tool_use's input from its JSON)."""
    blocks, json_text = [], {}
    for e in events:
        if e["type"] == "content_block_start":
            assert e["index"] == len(blocks)
            blocks.append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            delta, block = e["delta"], blocks[e["index"]]
            if delta["type"] == "input_json_delta":
                json_text[e["index"]] = json_text.get(e["index"], "") + delta["partial_json"]
            else:
                field = {"text_delta": "text", "thinking_delta": "thinking"}[delta["type"]]
                block[field] += delta[field]
        else:
            assert e == {"type": "content_block_stop", "index": len(blocks) - 1}
    for i, text in json_text.items():
        blocks[i]["input"] = json.loads(text)
    return [{k: v for k, v in b.items() if k != "id"} for b in blocks]


def test_the_whole_answer_is_thinking_text_and_tool_use_in_order():
    blocks = answer_blocks(FORMAT, TEXT, parallel=True)
    assert _without_ids(blocks.blocks) == [
        {"type": "thinking", "thinking": "The user wants weather.", "signature": ""},
        {"type": "text", "text": "Let me look.\n"},
        {"type": "tool_use", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "name": "get_time", "input": {}}]
    assert blocks.called and all(b.id.startswith("toolu_") for b in blocks.blocks[2:])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(TEXT)), max_size=12))
def test_any_split_streams_to_the_same_blocks(cuts):
    bounds = [0, *sorted(cuts), len(TEXT)]
    reader, blocks = FORMAT.stream(), ContentBlocks()
    events = [e for a, b in itertools.pairwise(bounds) for e in blocks.feed(reader.feed(TEXT[a:b]))]
    events += blocks.feed(reader.finish()) + blocks.finish()
    whole = _without_ids(answer_blocks(FORMAT, TEXT, parallel=True).blocks)
    assert _without_ids(blocks.blocks) == whole and _replayed(events) == whole


def test_whitespace_between_calls_makes_no_text_block():
    calls = TEXT[TEXT.index("<tool_call>"):]
    assert [b.type for b in answer_blocks(FORMAT, "\n" + calls + "\n", parallel=True).blocks] == ["tool_use"] * 2


def test_text_after_a_call_is_a_block_of_its_own():
    text = TEXT + "\nDone."
    assert [b.type for b in answer_blocks(FORMAT, text, parallel=True).blocks] == [
        "thinking", "text", "tool_use", "tool_use", "text"]


def test_without_parallel_calls_only_the_first_is_kept():
    blocks = answer_blocks(FORMAT, TEXT, parallel=False)
    assert [b.type for b in blocks.blocks] == ["thinking", "text", "tool_use"] and blocks.blocks[2].name == "get_weather"


def test_an_answer_without_calls_is_not_called():
    blocks = answer_blocks(FORMAT, "Just text.", parallel=True)
    assert _without_ids(blocks.blocks) == [{"type": "text", "text": "Just text."}] and not blocks.called
    assert answer_blocks(FORMAT, "  \n", parallel=True).blocks == []


def test_tool_use_ids_keep_the_random_part_of_the_call_id():
    assert tool_use_id("call_abc123") == "toolu_abc123"
    fresh = tool_use_id(None)
    assert fresh.startswith("toolu_") and len(fresh) == len("toolu_") + 24 and tool_use_id("x") != fresh
