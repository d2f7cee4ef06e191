"""/v1/messages and /v1/messages/count_tokens through the official anthropic client: answers equal to the chat
route's for the same conversation, streams that add up to the same answer in Anthropic's event order, stop
reasons, token counts, tools (tool_choice any and tool held to the input_schema, tool_use and tool_result blocks
rendered as the chat route renders calls and results), thinking turned off through the template, the x-api-key
header, and errors in Anthropic's JSON for what is not served (images, documents, Anthropic's own tools, ...)."""

import json

import anthropic
import jsonschema
import pytest
from test_tool_calls import ASK, SCHEMAS
from test_tool_calls import TOOLS as OPENAI_TOOLS

from hybridmoe.errors import HybridMoEError
from hybridmoe.server.anthropic_api import error_body
from hybridmoe.server.async_engine import EngineError, QueueFullError
from hybridmoe.server.serving_common import APIError

SYSTEM = "Be brief."
MESSAGES = [{"role": "user", "content": "Tell me about experts."}]
GREEDY = {"model": "tiny", "max_tokens": 24, "extra_body": {"temperature": 0}}
"""The client takes no sampling arguments (newer Claude models have none): temperature travels in extra_body."""
EVENT_ORDER = ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
               "message_delta", "message_stop"]


def _client(server, **kwargs) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=60, **kwargs)


def _events(raw: bytes) -> list[tuple[str, dict]]:
    """(event name, data) of each event of an SSE body."""
    events = []
    for block in raw.decode().split("\n\n"):
        if block.strip():
            fields = dict(line.split(": ", 1) for line in block.splitlines())
            events.append((fields["event"], json.loads(fields["data"])))
    return events


def _greedy_chat(server, max_tokens: int) -> tuple[str, str]:
    """(text, finish_reason) of the chat route for SYSTEM and MESSAGES, greedy."""
    r = server.client().chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": SYSTEM}, *MESSAGES], temperature=0,
        max_tokens=max_tokens)
    return r.choices[0].message.content, r.choices[0].finish_reason


def test_message_equals_the_chat_answer(server):
    expected, finish = _greedy_chat(server, 24)
    m = _client(server).messages.create(system=SYSTEM, messages=MESSAGES, metadata={"user_id": "u1"}, **GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == "tiny" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == expected
    assert m.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[finish] and m.stop_sequence is None
    assert 1 <= m.usage.output_tokens <= 24 and m.usage.cache_creation_input_tokens == 0
    count = _client(server).messages.count_tokens(model="tiny", system=SYSTEM, messages=MESSAGES).input_tokens
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == count


def test_system_blocks_read_as_the_system_prompt(server):
    client = _client(server)
    as_string = client.messages.create(system=SYSTEM, messages=MESSAGES, **GREEDY).content[0].text
    as_blocks = client.messages.create(system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
                                       messages=[{"role": "user", "content": [{"type": "text", "text": m["content"]}]}
                                                 for m in MESSAGES], **GREEDY).content[0].text
    assert as_blocks == as_string


def test_stream_adds_up_to_the_message_in_anthropic_order(server):
    whole = _client(server).messages.create(system=SYSTEM, messages=MESSAGES, **GREEDY)
    code, raw = server.post("/v1/messages", {"model": "tiny", "max_tokens": 24, "temperature": 0, "system": SYSTEM,
                                             "messages": MESSAGES, "stream": True})
    events = _events(raw)
    names = [name for name, _ in events]
    assert code == 200 and all(data["type"] == name for name, data in events)
    deltas = names.count("content_block_delta")
    assert names == EVENT_ORDER[:3] + ["content_block_delta"] * deltas + EVENT_ORDER[4:]
    text = "".join(data["delta"]["text"] for name, data in events if name == "content_block_delta")
    assert text == whole.content[0].text
    start, delta = events[0][1]["message"], events[-2][1]
    assert start["content"] == [] and start["stop_reason"] is None and start["model"] == "tiny"
    assert delta["delta"] == {"stop_reason": whole.stop_reason, "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == whole.usage.output_tokens


def test_stream_helper_final_message(server):
    client = _client(server)
    whole = client.messages.create(system=SYSTEM, messages=MESSAGES, **GREEDY)
    with client.messages.stream(system=SYSTEM, messages=MESSAGES, **GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert (final.usage.input_tokens + final.usage.cache_read_input_tokens
            == whole.usage.input_tokens + whole.usage.cache_read_input_tokens)


def test_max_tokens_ends_with_max_tokens(server):
    _, finish = _greedy_chat(server, 5)
    assert finish == "length", "the tiny model ends this answer within 5 tokens: pick another prompt"
    m = _client(server).messages.create(system=SYSTEM, messages=MESSAGES, **{**GREEDY, "max_tokens": 5})
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None and m.usage.output_tokens == 5


def test_stop_sequence_cuts_the_answer_and_is_named(server):
    client = _client(server)
    full, finish = _greedy_chat(server, 40)
    assert finish == "length" and len(full) > 13, "the tiny model ends this answer early: pick another prompt"
    stop = full[10:13]
    expected = full[:full.index(stop)]
    kwargs = dict(system=SYSTEM, messages=MESSAGES, stop_sequences=["\x00never", stop], **{**GREEDY, "max_tokens": 40})
    m = client.messages.create(**kwargs)
    assert m.content[0].text == expected and m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == expected and (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)


def test_count_tokens(server):
    client = _client(server)
    count = client.messages.count_tokens(model="tiny", messages=MESSAGES).input_tokens
    with_system = client.messages.count_tokens(model="tiny", system=SYSTEM, messages=MESSAGES).input_tokens
    assert 0 < count < with_system
    assert client.messages.count_tokens(model="tiny", system="", messages=MESSAGES).input_tokens == count
    ids = server.client().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1).usage.prompt_tokens
    assert count == ids
    # consecutive turns of one role are one turn, as Anthropic merges them
    split = [{"role": "user", "content": "Tell me"}, {"role": "user", "content": [{"type": "text", "text": "more."}]}]
    merged = [{"role": "user", "content": "Tell me\n\nmore."}]
    assert (client.messages.count_tokens(model="tiny", messages=split).input_tokens
            == client.messages.count_tokens(model="tiny", messages=merged).input_tokens)


def _block(type_: str, **fields) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": type_, **fields}]}]


def _assistant_turn(block: dict) -> list[dict]:
    return [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [block]},
            {"role": "user", "content": "Go on"}]


@pytest.mark.parametrize("fields, named", [
    ({"messages": _block("image", source={"type": "base64", "media_type": "image/png", "data": "AA=="})},
     "messages.0.content.1: content blocks of type 'image'"),
    ({"messages": _block("document", source={"type": "text", "media_type": "text/plain", "data": "x"})},
     "messages.0.content.1: content blocks of type 'document'"),
    ({"messages": _block("tool_result", tool_use_id="toolu_1", content=[{"type": "image", "source": {}}])},
     "messages.0.content.1.content.0: content blocks of type 'image'"),
    ({"messages": _block("tool_result", content="42")}, "messages.0.content.1.tool_use_id: a tool_result block"),
    ({"messages": _block("tool_use", id="toolu_1", name="f", input={})},
     "messages.0.content.1: content blocks of type 'tool_use'"),
    ({"messages": _assistant_turn({"type": "tool_use", "name": "f", "input": {}})},
     "messages.1.content.0.id: a tool_use block needs its id"),
    ({"messages": _assistant_turn({"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"})},
     "messages.1.content.0: content blocks of type 'tool_result'"),
    ({"messages": MESSAGES, "system": [{"type": "image"}]}, "system.0: content blocks of type 'image'"),
    ({"messages": MESSAGES, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type:"),
    ({"messages": MESSAGES, "tools": [{"name": "f"}]}, "tools.0.input_schema:"),
    ({"messages": MESSAGES, "tools": [{"name": "f", "input_schema": {"type": "string"}}]}, "tools.0.input_schema.type:"),
    ({"messages": MESSAGES, "tools": [{"name": "f", "input_schema": {"type": "object"}}] * 2}, "tools.1.name:"),
    ({"messages": MESSAGES, "tools": [{"name": "bad name", "input_schema": {"type": "object"}}]}, "tools.0.name:"),
    ({"messages": MESSAGES, "tool_choice": {"type": "any"}}, "tool_choice asks for tool calls"),
    ({"messages": MESSAGES, "tools": [{"name": "f", "input_schema": {"type": "object"}}],
      "tool_choice": {"type": "tool"}}, "tool_choice.name:"),
    ({"messages": MESSAGES, "tools": [{"name": "f", "input_schema": {"type": "object"}}],
      "tool_choice": {"type": "tool", "name": "g"}}, "tool_choice names 'g'"),
    ({"messages": MESSAGES, "thinking": {"type": "enabled"}}, "thinking.budget_tokens:"),
    ({"messages": MESSAGES, "thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens:"),
    ({"messages": MESSAGES, "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
     "output_config.format:"),
    ({"messages": [*MESSAGES, {"role": "assistant", "content": "The answer is"}]},
     "messages.1: the conversation ends with an assistant turn"),
    ({"messages": MESSAGES, "extra_body": {"temperature": 1.5}}, "temperature:"),
    ({"messages": [{"role": "system", "content": "Hi"}]}, "messages.0.role:"),
])
def test_unsupported_requests_are_400_in_anthropic_json(server, fields, named):
    with pytest.raises(anthropic.BadRequestError) as e:
        _client(server).messages.create(model="tiny", max_tokens=8, **fields)
    assert e.value.status_code == 400 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error" and named in e.value.body["error"]["message"]


def test_count_tokens_refuses_what_messages_refuses(server):
    with pytest.raises(anthropic.BadRequestError, match="content blocks of type 'image'"):
        _client(server).messages.count_tokens(model="tiny", messages=_block("image", source={}))


def test_disabled_thinking_and_tool_choice_auto_are_served(server):
    m = _client(server).messages.create(messages=MESSAGES, thinking={"type": "disabled"}, tool_choice={"type": "auto"},
                                        **GREEDY)
    assert m.content[0].type == "text"


def test_missing_max_tokens_is_400_in_anthropic_json(server):
    code, raw = server.post("/v1/messages", {"model": "tiny", "messages": MESSAGES})
    body = json.loads(raw)
    assert code == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("max_tokens:")
    code, raw = server.post("/v1/messages", b"{not json")
    assert code == 400 and json.loads(raw)["error"]["type"] == "invalid_request_error"


def test_unknown_model_is_not_found(server):
    with pytest.raises(anthropic.NotFoundError) as e:
        _client(server).messages.create(model="claude-opus-4-1", messages=MESSAGES, max_tokens=8)
    openai_message = json.loads(server.post("/v1/chat/completions", {"model": "claude-opus-4-1",
                                                                     "messages": MESSAGES})[1])["error"]["message"]
    assert e.value.status_code == 404 and e.value.body["error"] == {"type": "not_found_error",
                                                                    "message": openai_message}
    with pytest.raises(anthropic.NotFoundError):
        _client(server).messages.count_tokens(model="claude-opus-4-1", messages=MESSAGES)


def test_openai_routes_keep_openai_errors(server):
    code, raw = server.post("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "temperature": "hot"})
    assert code == 422 and json.loads(raw)["error"]["param"] == "temperature" and "type" not in json.loads(raw)


@pytest.mark.parametrize("credential", ["auth_token", "api_key"])
def test_the_api_key_as_bearer_token_or_x_api_key(small_server, credential):
    def client(key):
        return anthropic.Anthropic(base_url=small_server.url, max_retries=0, timeout=60, **{credential: key})

    assert client("test-key-123").messages.create(messages=MESSAGES, **GREEDY).content[0].type == "text"
    assert client("test-key-123").messages.count_tokens(model="tiny", messages=MESSAGES).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as e:
        client("wrong").messages.create(messages=MESSAGES, **GREEDY)
    assert e.value.status_code == 401 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "authentication_error" and "x-api-key" in e.value.body["error"]["message"]


def test_openai_routes_take_only_the_bearer_token(small_server):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1}
    code, raw = small_server.post("/v1/chat/completions", body, {"x-api-key": "test-key-123"})
    assert code == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key"
    code, raw = small_server.post("/v1/messages/count_tokens", {"model": "tiny", "messages": MESSAGES},
                                  {"x-api-key": "wrong"})
    assert code == 401 and json.loads(raw)["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("error, status, type_", [
    (APIError(422, "max_tokens: Field required"), 400, "invalid_request_error"),
    (APIError(400, "not served here", code="model_not_found"), 404, "not_found_error"),
    (APIError(413, "the request body is over 32 MiB"), 413, "request_too_large"),
    (QueueFullError("the server is busy"), 529, "overloaded_error"),
    (HybridMoEError("more sequences than this server holds"), 400, "invalid_request_error"),
    (EngineError("the engine failed"), 500, "api_error"),
])
def test_error_statuses_and_types(error, status, type_):
    assert error_body(error) == (status, {"type": "error", "error": {"type": type_, "message": str(error)}})


TOOLS = [{"name": f["name"], "input_schema": f["parameters"], "cache_control": {"type": "ephemeral"},
          **({"description": f["description"]} if "description" in f else {})}
         for f in (t["function"] for t in OPENAI_TOOLS)]
"""test_tool_calls' tools in Anthropic's layout (cache_control, which means nothing here, accepted)."""


def _sampled(seed: int, **fields) -> dict:
    """A request's arguments at temperature 1 with a seed (not Anthropic's: it travels in extra_body)."""
    return {"model": "tiny", "max_tokens": 400, "messages": ASK, "tools": TOOLS,
            "extra_body": {"temperature": 1.0, "seed": seed}, **fields}


def _calls(message) -> list[tuple[str, dict]]:
    """(name, input) of each tool_use block, each checked against its tool's input_schema."""
    calls = []
    for block in message.content:
        if block.type == "tool_use":
            assert block.id.startswith("toolu_") and len(block.id) > len("toolu_")
            jsonschema.validate(block.input, SCHEMAS[block.name])
            calls.append((block.name, block.input))
    return calls


def test_tool_choice_any_returns_tool_use_that_validates_for_every_seed(long_server):
    client = _client(long_server)
    for seed in range(10):
        m = client.messages.create(tool_choice={"type": "any"}, **_sampled(seed))
        assert m.stop_reason == "tool_use", (seed, m.content)
        assert [b.type for b in m.content] == ["tool_use"] * len(m.content) and _calls(m), (seed, m.content)


def test_tool_choice_tool_returns_exactly_that_tool(long_server):
    client = _client(long_server)
    for seed in range(5):
        m = client.messages.create(tool_choice={"type": "tool", "name": "get_time"}, **_sampled(seed))
        assert m.stop_reason == "tool_use" and [name for name, _ in _calls(m)] == ["get_time"], (seed, m.content)


def test_disable_parallel_tool_use_keeps_one_call(long_server):
    client = _client(long_server)
    for seed in range(3):
        m = client.messages.create(tool_choice={"type": "any", "disable_parallel_tool_use": True}, **_sampled(seed))
        assert len(_calls(m)) == 1 and len(m.content) == 1


def test_streamed_tool_use_assembles_to_the_message(long_server):
    client = _client(long_server)
    kwargs = _sampled(3, tool_choice={"type": "any"})
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert _calls(final) == _calls(whole) and final.stop_reason == whole.stop_reason == "tool_use"
    assert final.usage.output_tokens == whole.usage.output_tokens
    code, raw = long_server.post("/v1/messages", {**{k: v for k, v in kwargs.items() if k != "extra_body"},
                                                  **kwargs["extra_body"], "stream": True})
    events = _events(raw)
    assert code == 200 and [name for name, _ in events[:2]] == ["message_start", "ping"]
    blocks, open_index = [], None
    for name, data in events[2:-2]:
        if name == "content_block_start":
            assert open_index is None and data["index"] == len(blocks)
            block = data["content_block"]
            assert block["type"] == "tool_use" and block["input"] == {} and block["id"].startswith("toolu_")
            blocks.append({"name": block["name"], "json": ""})
            open_index = data["index"]
        elif name == "content_block_delta":
            assert data["index"] == open_index and data["delta"]["type"] == "input_json_delta"
            blocks[open_index]["json"] += data["delta"]["partial_json"]
        else:
            assert name == "content_block_stop" and data["index"] == open_index
            open_index = None
    assert open_index is None and [(b["name"], json.loads(b["json"])) for b in blocks] == _calls(whole)
    assert [name for name, _ in events[-2:]] == ["message_delta", "message_stop"]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_tool_choice_auto_answers_in_blocks(long_server):
    m = _client(long_server).messages.create(tool_choice={"type": "auto"}, **_sampled(0, max_tokens=16))
    assert m.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert all(b.type in ("thinking", "text", "tool_use") for b in m.content)
    _calls(m)


def test_tool_choice_none_leaves_the_tools_out_of_the_prompt(long_server):
    client = _client(long_server)
    plain = client.messages.count_tokens(model="tiny", messages=ASK).input_tokens
    offered = client.messages.count_tokens(model="tiny", messages=ASK, tools=TOOLS).input_tokens
    withheld = client.messages.count_tokens(model="tiny", messages=ASK, tools=TOOLS,
                                            tool_choice={"type": "none"}).input_tokens
    assert offered > plain + 50 and withheld == plain


def test_a_conversation_with_tool_use_and_tool_result_renders_as_the_chat_route_renders_it(long_server):
    calls = [("toolu_1", "get_weather", {"city": "Paris", "unit": "celsius"}), ("toolu_2", "get_time", {"zone": "CET"})]
    conversation = [*ASK, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Two tools.", "signature": "s"},
        *[{"type": "tool_use", "id": i, "name": n, "input": a} for i, n, a in calls]]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "14:05"}],
             "is_error": False}]}]
    openai_conversation = [
        {"role": "system", "content": SYSTEM}, *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}} for i, n, a in calls]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "14:05"}]
    client = _client(long_server)
    count = client.messages.count_tokens(model="tiny", system=SYSTEM, messages=conversation, tools=TOOLS).input_tokens
    chat = long_server.client().chat.completions.create(model="tiny", messages=openai_conversation,
                                                        tools=OPENAI_TOOLS, max_tokens=1, temperature=0)
    assert count == chat.usage.prompt_tokens
    m = client.messages.create(system=SYSTEM, messages=conversation, tools=TOOLS, **GREEDY)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == count


def test_thinking_disabled_changes_the_prompt(long_server):
    client = _client(long_server)

    def count(**thinking):
        return client.messages.count_tokens(model="tiny", messages=ASK, **thinking).input_tokens

    default = count()
    assert count(thinking={"type": "disabled"}) > default  # the empty <think></think> the template adds
    assert count(thinking={"type": "enabled", "budget_tokens": 2048}) == count(thinking={"type": "adaptive"}) == default
    m = client.messages.create(messages=ASK, thinking={"type": "disabled"}, **GREEDY)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == count(thinking={"type": "disabled"})
