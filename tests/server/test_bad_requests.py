"""Bad requests get OpenAI's error JSON with a status that says whose mistake it is (400: a bad
value, 422: a wrong field), none of them upsets the server, and a good request still works."""

import json

import openai
import pytest

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"model": "tiny", "prompt": "hi", "max_tokens": 4}


@pytest.mark.parametrize("path, body, status, message", [
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [', 400, "not valid JSON"),
    ("/v1/chat/completions", b'["a", "list"]', 400, "must be a JSON object"),
    ("/v1/chat/completions", {**CHAT, "model": "gpt-9"}, 400, "the model 'gpt-9' is not served here"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 100000}, 400, "max_tokens is 100000"),
    ("/v1/completions", {**COMPLETION, "prompt": [7, 99999]}, 400, "prompt token id 99999 is outside"),
    ("/v1/completions", {**COMPLETION, "prompt": []}, 400, "prompt is an empty list"),
    ("/v1/chat/completions", {**CHAT, "temperature": "hot"}, 422, "temperature: Input should be a valid number"),
    ("/v1/chat/completions", {**CHAT, "temperature": -1}, 422, "temperature: Input should be greater than"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": -5}, 422, "max_tokens: Input should be greater than"),
    ("/v1/chat/completions", {**CHAT, "n": 1000}, 422, "n: Input should be less than"),
    ("/v1/chat/completions", {**CHAT, "top_p": 7.5}, 422, "top_p"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 422, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, 422, "role"),
    ("/v1/chat/completions", {**CHAT, "stop": 5}, 422, "stop"),
    ("/v1/completions", {"model": "tiny"}, 422, "prompt: Field required"),
    ("/api/chat", {"model": "tiny", "messages": [], "options": {"temperature": "x"}}, 422, "options.temperature"),
])
def test_bad_request_answers_openai_error(server, path, body, status, message):
    code, raw = server.post(path, body)
    assert code == status
    error = json.loads(raw)["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"


def test_context_error_names_both_numbers(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().completions.create(model="tiny", prompt="hi", max_tokens=600)
    message = e.value.body["message"]
    assert "max_tokens is 600" in message and "context of 512 tokens" in message
    assert e.value.body["code"] == "context_length_exceeded"


def test_openai_client_sees_typed_errors(server):
    client = server.client()
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       extra_body={"top_k": -7})
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_bad_requests_leave_the_server_serving(server):
    for _ in range(3):
        assert server.post("/v1/completions", b"{{{")[0] == 400
        assert server.post("/v1/completions", {**COMPLETION, "temperature": []})[0] == 422
    assert server.get("/health")[0] == 200
    r = server.client().completions.create(**COMPLETION)
    assert r.choices[0].finish_reason in ("stop", "length")
