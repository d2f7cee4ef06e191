"""Ollama's routes: /api/chat and /api/generate (NDJSON streams by default, or one object),
/api/tags, /api/version; the answers match the OpenAI routes' for the same greedy request."""

import json

OPTIONS = {"temperature": 0, "num_predict": 12}
MESSAGES = [{"role": "user", "content": "Hello Ollama"}]


def _lines(raw: bytes) -> list[dict]:
    return [json.loads(line) for line in raw.decode().splitlines()]


def test_chat_streams_ndjson_equal_to_openai(server):
    expected = server.client().chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=0, max_tokens=12).choices[0].message.content
    code, raw = server.post("/api/chat", {"model": "tiny", "messages": MESSAGES, "options": OPTIONS})
    lines = _lines(raw)
    assert code == 200 and lines[-1]["done"] is True and not any(line["done"] for line in lines[:-1])
    assert "".join(line["message"]["content"] for line in lines) == expected
    assert lines[-1]["done_reason"] in ("stop", "length") and lines[-1]["prompt_eval_count"] > 0
    assert lines[-1]["eval_count"] <= 12


def test_chat_without_stream_and_tagged_model_name(server):
    code, raw = server.post("/api/chat", {"model": "tiny:latest", "messages": MESSAGES, "stream": False,
                                          "options": OPTIONS})
    body = json.loads(raw)
    assert code == 200 and body["done"] is True and body["message"]["role"] == "assistant"
    streamed = _lines(server.post("/api/chat", {"model": "tiny", "messages": MESSAGES, "options": OPTIONS})[1])
    assert body["message"]["content"] == "".join(line["message"]["content"] for line in streamed)


def test_generate_raw_equals_completion(server):
    prompt = "Raw prompt text"
    expected = server.client().completions.create(model="tiny", prompt=prompt, temperature=0,
                                                  max_tokens=12).choices[0].text
    code, raw = server.post("/api/generate", {"model": "tiny", "prompt": prompt, "raw": True, "stream": False,
                                              "options": OPTIONS})
    assert code == 200 and json.loads(raw)["response"] == expected
    streamed = _lines(server.post("/api/generate", {"model": "tiny", "prompt": prompt, "raw": True,
                                                    "options": OPTIONS})[1])
    assert "".join(line["response"] for line in streamed) == expected


def test_generate_uses_the_chat_template_unless_raw(server):
    chat = server.client().chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "Sys"}, {"role": "user", "content": "Q"}],
        temperature=0, max_tokens=12).choices[0].message.content
    code, raw = server.post("/api/generate", {"model": "tiny", "prompt": "Q", "system": "Sys", "stream": False,
                                              "options": OPTIONS})
    assert code == 200 and json.loads(raw)["response"] == chat


def test_tags_version_and_unknown_model(server):
    code, raw = server.get("/api/tags")
    assert code == 200 and [m["name"] for m in json.loads(raw)["models"]] == ["tiny"]
    assert "version" in json.loads(server.get("/api/version")[1])
    code, raw = server.post("/api/chat", {"model": "llama3", "messages": MESSAGES})
    assert code == 400 and "not served here" in json.loads(raw)["error"]["message"]
