"""The work a prompt costs is bounded before it is done: a text longer than the context could hold is a 400
naming the limit before it is tokenized, a token-id prompt is checked for length before its ids, and the
chat template and the tokenizer run off the event loop, so /metrics and /health answer while prompts
render."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from hybridmoe.server.prompts import MAX_CHARS_PER_TOKEN

CONTEXT = 512  # the tiny checkpoint's max_model_len
RENDER_SLOWLY = "render slowly"  # the conversation slow_template_server's template takes long to render
SLOW_RENDERS = 6  # at once, on the server's two prompt threads: seconds of rendering in all
LIMIT = CONTEXT * MAX_CHARS_PER_TOKEN


def _text_body(path: str, text: str) -> dict:
    if path == "/v1/chat/completions":
        return {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 4}
    if path == "/api/generate":
        return {"model": "tiny", "prompt": text, "raw": True, "stream": False}
    return {"model": "tiny", "prompt": text, "max_tokens": 4}


def _error(raw: bytes) -> dict:
    return json.loads(raw)["error"]


def test_a_31_mb_prompt_is_a_400_naming_the_limit(server):
    text = "x" * 31_000_000
    code, raw = server.alongside(lambda: server.post("/v1/completions", _text_body("/v1/completions", text)))
    assert code == 400
    error = _error(raw)
    assert f"has {len(text)} characters" in error["message"] and f"at most {LIMIT}" in error["message"]
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"
    assert server.get("/health")[0] == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/api/generate"])
def test_the_character_limit_comes_before_the_tokenizer(server, path):
    over = "x" * (LIMIT + 1)
    code, raw = server.alongside(lambda: server.post(path, _text_body(path, over)))
    assert code == 400 and f"at most {LIMIT}" in _error(raw)["message"]
    # a text under the limit is tokenized, and its tokens (one an "x") are what leaves no room
    code, raw = server.post(path, _text_body(path, "x" * (LIMIT // 2)))
    assert code == 400 and "which leaves no room in the context of 512 tokens" in _error(raw)["message"]


def test_more_messages_than_the_context_has_tokens(server):
    messages = [{"role": "user", "content": ""}] * CONTEXT
    code, raw = server.post("/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 4})
    assert code == 400 and f"messages holds {CONTEXT} messages" in _error(raw)["message"]


def test_token_id_prompt_length_is_checked_before_its_ids(server):
    ids = [7] * (CONTEXT - 1) + [99999]  # too long, and its last id outside the vocabulary
    code, raw = server.post("/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 1})
    assert code == 400 and "the prompt has 512 tokens, which leaves no room" in _error(raw)["message"]


def test_metrics_and_health_answer_while_chat_templates_render(slow_template_server):
    server = slow_template_server
    body = {"model": "tiny", "messages": [{"role": "user", "content": RENDER_SLOWLY}], "max_tokens": 1}
    seen = []

    def rendering() -> bool:
        seen.append(server.metric("prompts_preparing"))
        return seen[-1] > 0 or all(r.done() for r in renders)

    with ThreadPoolExecutor(SLOW_RENDERS) as pool:
        renders = [pool.submit(server.post, "/v1/chat/completions", body) for _ in range(SLOW_RENDERS)]
        # The gauge is raised on the event loop before a render and lowered after it: only a loop that is
        # free while a template renders ever answers with it above 0.
        server.wait_until(rendering, timeout=120, what="the renders")
        assert max(seen) > 0
        assert server.get("/health")[0] == 200
        server.alongside(lambda: None)  # a plain prompt gets its solo answer meanwhile
        # each render ends, within the template's bounds (200) or past them (400)
        assert all(r.result()[0] in (200, 400) for r in renders)
