"""A chat choice read as reasoning, answer and tool calls: streamed in any pieces it assembles to what the whole
text parses to, a call streams its name before its arguments, and the request's tools plan picks the reader
from the chat template."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridmoe.server.chat_output import ChatOutputFormat
from hybridmoe.server.protocol import ChatCompletionRequest
from hybridmoe.server.reasoning import reasoning_parser
from hybridmoe.server.serving_common import APIError
from hybridmoe.server.tool_choice import plan_tools
from hybridmoe.server.tool_parsers import parser_for_template
from hybridmoe.server.tool_parsers.base import assemble

QWEN_TEMPLATE = "... <tool_call> ... <think> ..."
TEXT = ('<think>\nThe user wants weather.\n</think>\n\nLet me look.\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
        '</tool_call>')
FORMAT = ChatOutputFormat(parser_for_template(QWEN_TEMPLATE), reasoning_parser(QWEN_TEMPLATE, "prompt"))


def test_the_whole_text_parses_into_reasoning_answer_and_calls():
    parsed = FORMAT.parse(TEXT)
    assert parsed.reasoning == "The user wants weather."
    assert parsed.content.strip() == "Let me look."
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("get_weather", '{"city":"Paris"}'),
                                                                   ("get_time", "{}")]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(TEXT)), max_size=12))
def test_any_split_streams_to_the_parse(cuts):
    bounds = [0, *sorted(cuts), len(TEXT)]
    reader = FORMAT.stream()
    deltas = [d for a, b in zip(bounds, bounds[1:]) for d in reader.feed(TEXT[a:b])] + reader.finish()
    streamed, whole = assemble(deltas), FORMAT.parse(TEXT)
    assert (streamed.content, streamed.reasoning) == (whole.content, whole.reasoning)
    assert [(c.name, c.arguments) for c in streamed.tool_calls] == [(c.name, c.arguments) for c in whole.tool_calls]
    firsts = {}
    for d in deltas:
        if d.index is not None and d.index not in firsts:
            firsts[d.index] = d
    assert all(d.name and d.id and not d.arguments for d in firsts.values())  # the name goes first


def test_without_a_reader_the_text_is_the_answer():
    parsed = ChatOutputFormat().parse(" <tool_call> as typed ")
    assert parsed.content == " <tool_call> as typed " and parsed.tool_calls == [] and parsed.reasoning is None


def test_a_prompt_that_opens_think_starts_the_output_in_reasoning():
    assert reasoning_parser(QWEN_TEMPLATE, "<|im_start|>assistant\n<think>\n").starts_in_reasoning
    assert not reasoning_parser(QWEN_TEMPLATE, "<|im_start|>assistant\n").starts_in_reasoning
    assert reasoning_parser("{{ messages }}", "<think>") is None


def _request(**kw):
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **kw})


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


def test_plan_tools_reads_the_template_and_refuses_what_it_cannot_do():
    plan = plan_tools(QWEN_TEMPLATE, _request(tools=TOOLS))
    assert plan.parser.name == "hermes" and plan.structured is None and plan.template_kwargs["tools"][0]["function"]
    assert plan_tools(QWEN_TEMPLATE, _request(tools=TOOLS, tool_choice="required")).structured.kind == "lark"
    assert plan_tools(QWEN_TEMPLATE, _request(tools=TOOLS, tool_choice="none")).template_kwargs == {}
    harmony = "<|channel|> ... <|call|>"
    assert plan_tools(harmony, _request()).parser.name == "harmony"  # its channels need its reader anyway
    with pytest.raises(APIError, match="no tool-call format"):
        plan_tools("{{ messages }}", _request(tools=TOOLS))
    assert plan_tools("<|channel|> <|call|>", _request(tools=TOOLS, tool_choice="required")).structured.kind == "lark"
    with pytest.raises(APIError, match="no tools"):
        plan_tools(QWEN_TEMPLATE, _request(tool_choice="required"))
