"""What the server does not do yet is refused with a 400 naming the field, never answered in plain text as if
it were done: tool calls (tools, a tool_choice that needs them). Values that ask for nothing (no tools,
tool_choice none/auto, response_format text) are accepted."""

import openai
import pytest

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
HELLO = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize("extra,param", [
    ({"tools": [TOOL]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
])
def test_a_request_for_tool_calls_is_refused(server, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model="tiny", messages=HELLO, max_tokens=2, **extra)
    assert e.value.status_code == 400 and "not supported yet" in str(e.value)
    assert e.value.body["param"] == param


def test_values_that_ask_for_nothing_are_accepted(server):
    for extra in ({"tool_choice": "none"}, {"tool_choice": "auto"}, {"response_format": {"type": "text"}}):
        r = server.client().chat.completions.create(model="tiny", messages=HELLO, max_tokens=2, **extra)
        assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("path,body,param", [
    ("/api/chat", {"messages": HELLO, "tools": [TOOL]}, "tools"),
])
def test_ollama_tools_are_refused(server, path, body, param):
    import json

    code, raw = server.post(path, {"model": "tiny", "stream": False, **body})
    assert code == 400 and "not supported yet" in raw.decode()
    assert json.loads(raw)["error"]["param"] == param
