"""Every sampling parameter is checked by SamplingParams before the prompt is read: a value it refuses (a
temperature so small that every logit overflows, more or longer stop strings than its bounds) is a 400
whose message names the field, and a greedy request beside it gets its solo answer."""

import json

import pytest

from hybridmoe.sampling_params import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOTAL_CHARS,
)

COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
LONG_STOPS = ["s" * MAX_STOP_CHARS] * (MAX_STOP_TOTAL_CHARS // MAX_STOP_CHARS + 1)


@pytest.mark.parametrize("path, fields, field", [
    ("/v1/completions", {"temperature": 1e-40}, "temperature"),
    ("/v1/chat/completions", {"temperature": 1e-40}, "temperature"),
    ("/v1/completions", {"repetition_penalty": 1e-300}, "repetition_penalty"),
    ("/v1/chat/completions", {"top_k": 10**30}, "top_k"),
    ("/v1/completions", {"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ("/v1/chat/completions", {"stop": ["s" * (MAX_STOP_CHARS + 1)]}, "stop"),
    ("/v1/completions", {"stop": LONG_STOPS}, "stop"),
    ("/v1/completions", {"stop_token_ids": [1] * (MAX_STOP_STRINGS + 1)}, "stop_token_ids"),
], ids=["temperature", "chat-temperature", "repetition_penalty", "top_k", "stop-count", "stop-length",
        "stop-total", "stop_token_ids"])
def test_a_value_sampling_params_refuses_is_a_400_naming_the_field(server, path, fields, field):
    body = {**(CHAT if path == "/v1/chat/completions" else COMPLETION), **fields}
    code, raw = server.alongside(lambda: server.post(path, body))
    assert code == 400
    error = json.loads(raw)["error"]
    assert field in error["message"] and error["type"] == "invalid_request_error"
    assert "\n" not in error["message"] and len(error["message"]) < 300


@pytest.mark.parametrize("options, field", [
    ({"temperature": 1e-40}, "temperature"),
    ({"repeat_penalty": 1e-300}, "repetition_penalty"),
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
])
def test_ollama_options_are_checked_the_same_way(server, options, field):
    body = {"model": "tiny", "prompt": "hi", "stream": False, "options": options}
    code, raw = server.alongside(lambda: server.post("/api/generate", body))
    assert code == 400 and field in json.loads(raw)["error"]["message"]


def test_sampling_params_are_checked_before_the_prompt(server):
    body = {**COMPLETION, "prompt": "x" * 10**6, "stop": ["x"] * (MAX_STOP_STRINGS + 1)}
    code, raw = server.post("/v1/completions", body)
    assert code == 400 and json.loads(raw)["error"]["message"].startswith("stop ")


def test_stop_strings_within_the_bounds_are_served(server):
    stops = ["\x00never"] * MAX_STOP_STRINGS
    code, raw = server.post("/v1/completions", {**COMPLETION, "stop": stops, "temperature": 0})
    assert code == 200 and json.loads(raw)["choices"][0]["finish_reason"] in ("stop", "length")
