"""response_format through the official openai client against a real server on a random-weight model: the
output is held to the JSON schema (it parses and validates, whatever the model's noise prefers), streamed or
not, in chat and completions; a schema the grammar engine cannot use is a 400 naming response_format."""

import json

import jsonschema
import openai
import pytest

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "size": {"enum": ["small", "medium", "large"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "owner": {"type": "object",
                  "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "admin": {"type": "boolean"}},
                  "required": ["id", "admin"], "additionalProperties": False},
    },
    "required": ["name", "count", "size", "tags", "owner"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}
HELLO = [{"role": "user", "content": "Describe an item as JSON."}]


def test_json_schema_output_validates_for_every_seed(server):
    client = server.client()
    for seed in range(20):
        r = client.chat.completions.create(model="tiny", messages=HELLO, response_format=FORMAT, temperature=1.0,
                                           seed=seed, max_tokens=300)
        assert r.choices[0].finish_reason == "stop", (seed, r.choices[0].message.content)
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_streamed_json_schema_output_is_the_same_output(server):
    client = server.client()
    kwargs = dict(model="tiny", messages=HELLO, response_format=FORMAT, temperature=1.0, seed=7, max_tokens=300)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(streamed), SCHEMA)


def test_completions_take_a_response_format_too(server):
    r = server.client().completions.create(model="tiny", prompt="An item:", max_tokens=300, temperature=0,
                                           extra_body={"response_format": FORMAT})  # vLLM's extension
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


def test_constrained_and_free_requests_share_a_batch(server):
    """Free requests beside constrained ones get the tokens they get alone (greedy)."""
    client = server.client()
    alone = client.chat.completions.create(model="tiny", messages=HELLO, temperature=0, max_tokens=16)
    import concurrent.futures as cf

    with cf.ThreadPoolExecutor(4) as pool:
        constrained = [pool.submit(client.chat.completions.create, model="tiny", messages=HELLO, seed=s,
                                   response_format=FORMAT, temperature=1.0, max_tokens=300) for s in range(3)]
        free = pool.submit(client.chat.completions.create, model="tiny", messages=HELLO, temperature=0,
                           max_tokens=16)
        assert free.result().choices[0].message.content == alone.choices[0].message.content
        for f in constrained:
            jsonschema.validate(json.loads(f.result().choices[0].message.content), SCHEMA)


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
        "a": {"$ref": "#/definitions/missing"}}}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}},
    {"type": "json_schema"},
])
def test_a_schema_that_cannot_be_used_is_a_400(server, response_format):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model="tiny", messages=HELLO, response_format=response_format,
                                                max_tokens=8)
    assert e.value.body["param"] == "response_format"


def test_ollama_format_takes_json_and_a_schema(server):
    code, raw = server.post("/api/chat", {"model": "tiny", "stream": False, "messages": HELLO, "format": SCHEMA,
                                          "options": {"seed": 3, "num_predict": 300}})
    assert code == 200, raw
    jsonschema.validate(json.loads(json.loads(raw)["message"]["content"]), SCHEMA)
    code, raw = server.post("/api/generate", {"model": "tiny", "stream": False, "prompt": "hi", "format": "json",
                                              "options": {"seed": 3, "num_predict": 300}})
    body = json.loads(raw)
    assert code == 200 and (body["done_reason"] == "length" or isinstance(json.loads(body["response"]), dict))
    code, raw = server.post("/api/chat", {"model": "tiny", "stream": False, "messages": HELLO, "format": "yaml"})
    assert code == 400 and json.loads(raw)["error"]["param"] == "format"


def test_a_held_answer_is_the_content_where_the_prompt_opens_reasoning(special_token_tools_server):
    """MiniMax-M2's template leaves <think> open at the end of the prompt: the grammar closes the reasoning first,
    so the JSON is the answer (content), not reasoning; the other templates' answers are held as they are."""
    client = special_token_tools_server.client()
    for seed in range(4):
        r = client.chat.completions.create(model="tiny", messages=HELLO, response_format=FORMAT, temperature=1.0,
                                           seed=seed, max_tokens=1500)
        message = r.choices[0].message
        assert r.choices[0].finish_reason == "stop", (seed, message)
        jsonschema.validate(json.loads(message.content), SCHEMA)
        assert not getattr(message, "reasoning_content", None), (seed, message)
