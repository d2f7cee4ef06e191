"""A request that can never fit (prompts x n above the batch plus the queue) is a 400, not the 429 that
says "busy now, retry": on small_server (--max-batch 1 --max-queue 1), two sequences fit, three never."""

import json

import pytest

KEY = "test-key-123"  # small_server's --api-key
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2, "n": 3}),
    ("/v1/completions", {"model": "tiny", "prompt": ["x", "y"], "max_tokens": 2, "n": 2}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                              "n": 3}),
])
def test_a_group_larger_than_the_server_is_a_400(small_server, path, body):
    code, raw = small_server.alongside(lambda: small_server.post(path, body, AUTH))
    assert code == 400
    error = json.loads(raw)["error"]
    assert error["type"] == "invalid_request_error"
    assert "more than this server ever holds: 1 running and 1 waiting" in error["message"]


def test_a_group_of_the_server_size_is_served(small_server):
    code, raw = small_server.post("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2, "n": 2}, AUTH)
    assert code == 200 and len(json.loads(raw)["choices"]) == 2
