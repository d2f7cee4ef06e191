"""Bodies no client library would send: JSON nested past any schema, text that is not valid Unicode. Each is a
400 with a one-line message naming the problem (never a 500), and a request beside it gets its solo answer."""

import json

import pytest

NESTED = "[" * 100_000 + "]" * 100_000


def _error(raw: bytes) -> dict:
    error = json.loads(raw)["error"]
    assert "\n" not in error["message"]
    return error


@pytest.mark.parametrize("path, field", [
    ("/v1/completions", "prompt"),
    ("/v1/chat/completions", "metadata"),  # a field the server ignores
    ("/api/generate", "options"),
])
def test_deeply_nested_json_is_a_400(server, path, field):
    body = f'{{"model": "tiny", "{field}": {NESTED}}}'
    code, raw = server.alongside(lambda: server.post(path, body.encode()))
    assert code == 400
    assert _error(raw)["message"] == "the request body's JSON is nested too deeply"


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"model": "tiny", "prompt": "a\ud800b"}, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": ["fine", "a\udfffb"]}, "prompt.1"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stop": ["\ud800"]}, "stop.0"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "a\ud800b"}]},
     "messages.0.content"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "ok"}, {"type": "text", "text": "\udc00"}]}]},
     "messages.0.content.1.text"),
    ("/v1/chat/completions", {"model": "\ud800", "messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("/api/chat", {"model": "tiny", "messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
    ("/api/generate", {"model": "tiny", "prompt": "\ud800", "stream": False}, "prompt"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(server, path, body, param):
    raw_body = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as a \\ud800 escape
    code, raw = server.alongside(lambda: server.post(path, raw_body))
    assert code == 400
    error = _error(raw)
    assert error["param"] == param and error["code"] == "invalid_unicode"
    assert error["message"].startswith(f"{param}: holds a lone surrogate (U+")


def test_surrogates_encoded_in_utf8_bytes_are_a_400(server):
    body = b'{"model": "tiny", "prompt": "a\xed\xa0\x80b"}'  # U+D800 in UTF-8's form, which UTF-8 forbids
    code, raw = server.alongside(lambda: server.post("/v1/completions", body))
    assert code == 400 and _error(raw)["message"].startswith("prompt: holds a lone surrogate (U+D800)")


def test_bytes_that_are_not_utf8_are_a_400(server):
    code, raw = server.post("/v1/completions", b'{"model": "tiny", "prompt": "a\xffb"}')
    assert code == 400 and _error(raw)["message"].startswith("the request body is not valid JSON")


def test_a_valid_surrogate_pair_is_one_character(server):
    r = server.post("/v1/completions", json.dumps({"model": "tiny", "prompt": "smile \U0001F600",
                                                   "max_tokens": 2}).encode())
    assert r[0] == 200
