"""An Anthropic request as the chat route's input: turns merged as Anthropic merges them, tool_use blocks as the
assistant's tool_calls, tool_result blocks as tool messages in their order, earlier thinking left out; tools and
tool_choice planned as OpenAI's equivalents are, thinking disabled as enable_thinking false."""

import pytest

from hybridmoe.server.anthropic_chat import chat_input
from hybridmoe.server.anthropic_protocol import ConversationRequest
from hybridmoe.server.serving_common import APIError

QWEN_TEMPLATE = "... <tool_call> ... <think> ..."
TOOLS = [{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}}}},
         {"name": "g", "description": "G.", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}]


def _input(messages, **fields):
    return chat_input(QWEN_TEMPLATE, ConversationRequest.model_validate({"model": "m", "messages": messages,
                                                                         **fields}))


def test_blocks_become_the_chat_layout_in_order():
    chat = _input([
        {"role": "user", "content": "Hi"}, {"role": "user", "content": [{"type": "text", "text": "there"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hm", "signature": "s"}, {"type": "text", "text": "Calling."},
            {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"a": 1}},
            {"type": "redacted_thinking", "data": "x"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_2", "name": "g", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "1"},
                                                                          {"type": "text", "text": "2"}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True}, {"type": "text", "text": "So?"}]}],
        system=[{"type": "text", "text": "Be brief."}], tools=TOOLS)
    assert chat.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi\n\nthere"},
        {"role": "assistant", "content": "Calling.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}},
            {"id": "toolu_2", "type": "function", "function": {"name": "g", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "1\n\n2"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": ""},
        {"role": "user", "content": "So?"}]
    assert chat.plan.parser.name == "hermes" and chat.plan.structured is None and chat.plan.parallel
    assert chat.plan.template_kwargs == {"tools": [
        {"type": "function", "function": {"name": "f", "parameters": TOOLS[0]["input_schema"]}},
        {"type": "function", "function": {"name": "g", "description": "G.", "parameters": {"type": "object"}}}]}


ASK = [{"role": "user", "content": "Hi"}]


def test_tool_choice_and_thinking_are_planned_as_openais():
    assert _input(ASK, tools=TOOLS, tool_choice={"type": "any"}).plan.structured.kind == "lark"
    named = _input(ASK, tools=TOOLS, tool_choice={"type": "tool", "name": "g"}).plan
    assert named.structured.kind == "lark" and not named.parallel
    assert not _input(ASK, tools=TOOLS, tool_choice={"type": "auto", "disable_parallel_tool_use": True}).plan.parallel
    assert "tools" not in _input(ASK, tools=TOOLS, tool_choice={"type": "none"}).plan.template_kwargs
    assert _input(ASK, tool_choice={"type": "auto"}).plan.parser is None
    assert _input(ASK, thinking={"type": "disabled"}).plan.template_kwargs == {"enable_thinking": False}
    assert _input(ASK, thinking={"type": "enabled", "budget_tokens": 1024}).plan.template_kwargs == {}


@pytest.mark.parametrize("messages, fields, param", [
    ([{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}], {},
     "messages.0.content.0.type"),
    ([*ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f"}]}, *ASK], {},
     "messages.1.content.0.input"),
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}]}],
     {}, "messages.0.content.0.content.0.type"),
    ([*ASK, {"role": "assistant", "content": "Sure"}], {}, "messages.1"),
    (ASK, {"tools": [{"name": "f", "type": "bash_20250124"}]}, "tools.0.type"),
    (ASK, {"tools": TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    (ASK, {"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(messages, fields, param):
    with pytest.raises(APIError) as e:
        _input(messages, **fields)
    assert e.value.status == 400 and e.value.param == param and e.value.message.startswith(param.removesuffix(".type"))
