"""Tool calls through the official openai client against a real server on a random-weight Qwen3-shaped model
(its chat template lays tools out as Qwen's does): tool_choice "required" and a named function hold the output to
calls whose arguments validate against the tool's parameters; streamed call deltas assemble to the non-streamed
calls; a conversation with calls and tool results renders as transformers renders it. The same forced calls on
DeepSeek-V3- and GLM-4.5-shaped models, whose tool-call markers are special tokens."""

import json
from pathlib import Path

import jsonschema
import openai
import pytest
from transformers import PreTrainedTokenizerFast

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 10},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_calls(calls):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_returns_calls_that_validate_for_every_seed(long_server):
    client = long_server.client()
    for seed in range(20):
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=1.0, seed=seed, max_tokens=400)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", (seed, choice.message)
        _check_calls(choice.message.tool_calls)
        assert choice.message.content is None


def test_a_named_function_gets_exactly_one_call_of_it(long_server):
    for seed in range(5):
        r = long_server.client().chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=400,
            tool_choice={"type": "function", "function": {"name": "get_time"}})
        calls = r.choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].function.name == "get_time"
        _check_calls(calls)


def test_parallel_tool_calls_false_keeps_one_call(long_server):
    for seed in range(5):
        r = long_server.client().chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                                    parallel_tool_calls=False, temperature=1.0, seed=seed,
                                                    max_tokens=400)
        assert len(r.choices[0].message.tool_calls) == 1


def test_streamed_call_deltas_assemble_to_the_same_calls(long_server):
    client = long_server.client()
    kwargs = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=3,
                  max_tokens=400)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls, finish = {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                if d.index not in calls:  # a call's first delta names it
                    assert d.id and d.function.name
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls]


def test_a_conversation_with_calls_and_results_renders_as_transformers_renders_it(long_server):
    conversation = [
        {"role": "system", "content": "Be brief."}, *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21"},
        {"role": "tool", "tool_call_id": "call_2", "content": "14:05"}]
    r = long_server.client().chat.completions.create(model="tiny", messages=conversation, tools=TOOLS, max_tokens=4,
                                                temperature=0)
    model_dir = Path(long_server.model_dir)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    hf.chat_template = json.loads((model_dir / "tokenizer_config.json").read_text())["chat_template"]
    for m in conversation:  # transformers' templates read the arguments as objects, as the server passes them
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    text = hf.apply_chat_template(conversation, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<tool_response>\nsunny, 21\n</tool_response>" in text and '"name": "get_time"' in text
    assert r.usage.prompt_tokens == len(hf(text, add_special_tokens=False)["input_ids"])


def test_auto_answers_in_text_or_calls(long_server):
    r = long_server.client().chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, temperature=0,
                                                max_tokens=16)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls


def test_thinking_can_be_turned_off_through_the_template(long_server):
    client = long_server.client()
    plain = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2, temperature=0)
    off = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2, temperature=0,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens > plain.usage.prompt_tokens  # the empty <think></think> the template adds


@pytest.mark.parametrize("extra,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"extra_body": {"chat_template_kwargs": {"messages": 1}}}, "chat_template_kwargs"),
])
def test_tool_requests_that_cannot_be_honoured_are_a_400(long_server, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        long_server.client().chat.completions.create(model="tiny", messages=ASK, max_tokens=4, **extra)
    assert e.value.body["param"] == param


def test_a_tool_name_outside_openais_pattern_is_refused(long_server):
    with pytest.raises(openai.UnprocessableEntityError, match="tools.0.function.name"):
        long_server.client().chat.completions.create(
            model="tiny", messages=ASK, max_tokens=4, tools=[{"type": "function", "function": {"name": "bad name!"}}])


def test_ollama_chat_takes_tools_and_think(long_server):
    """Ollama's /api/chat: tools rendered into the prompt (the prompt grows by them), a tool result message
    accepted, think false rendered through the template; the answer is a message with content (and tool_calls
    when the model wrote calls)."""
    def chat(**body):
        code, raw = long_server.post("/api/chat", {"model": "tiny", "stream": False, "messages": ASK,
                                                   "options": {"num_predict": 4, "temperature": 0}, **body})
        assert code == 200, raw
        return json.loads(raw)

    plain, tooled = chat(), chat(tools=TOOLS)
    assert tooled["prompt_eval_count"] > plain["prompt_eval_count"] + 50
    assert chat(think=False)["prompt_eval_count"] > plain["prompt_eval_count"]
    history = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
        {"role": "tool", "tool_name": "get_weather", "content": "sunny"}]
    answer = chat(messages=history, tools=TOOLS)
    assert answer["message"]["role"] == "assistant" and "content" in answer["message"]
    code, raw = long_server.post("/api/chat", {"model": "tiny", "stream": True, "messages": ASK, "tools": TOOLS,
                                               "options": {"num_predict": 8, "temperature": 0}})
    lines = [json.loads(x) for x in raw.decode().splitlines()]
    assert code == 200 and lines[-1]["done"] is True


def test_values_that_ask_for_nothing_are_accepted(server):
    for extra in ({"tool_choice": "none"}, {"response_format": {"type": "text"}}, {"tools": TOOLS[:1],
                                                                                   "tool_choice": "none"}):
        r = server.client().chat.completions.create(model="tiny", messages=ASK, max_tokens=2, **extra)
        assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.tool_calls is None


@pytest.mark.parametrize("field,value", [("functions", [{"name": "f", "parameters": {}}]),
                                         ("function_call", "auto"), ("logit_bias", {"5": 10})])
def test_openai_fields_that_would_change_the_answer_are_a_400(server, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model="tiny", messages=ASK, max_tokens=2, extra_body={field: value})
    assert e.value.body["param"] == field


def test_calls_written_with_special_tokens_validate(special_token_tools_server):
    """DeepSeek-V3's, GLM-4.5's and MiniMax-M2's formats, whose markers are special tokens: the forced grammar names them by id,
    the text keeps them for the parser, and the calls come back whole, streamed or not."""
    client = special_token_tools_server.client()
    for seed in range(8):
        kwargs = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed,
                      max_tokens=1500)
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls", (seed, choice.message)
        _check_calls(choice.message.tool_calls)
        streamed = {}
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                streamed.setdefault(d.index, {"name": d.function.name, "arguments": ""})
                streamed[d.index]["arguments"] += d.function.arguments or ""
        assert [streamed[i] for i in sorted(streamed)] == [
            {"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls]
