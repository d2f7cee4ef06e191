"""`hybridmoe serve --model org/name` serves a Hugging Face repo id from the Hub cache, under that id (as vLLM
does), with the answers the same checkpoint gives by path."""

import json


def test_a_repo_id_is_served_under_its_name_with_the_answers_of_its_path(hub_server, server):
    code, raw = hub_server.get("/v1/models")
    assert code == 200 and [m["id"] for m in json.loads(raw)["data"]] == ["org/tiny"]
    body = {"prompt": "hello there", "max_tokens": 6, "temperature": 0}
    by_name = hub_server.post("/v1/completions", {**body, "model": "org/tiny"})
    by_path = server.post("/v1/completions", {**body, "model": "tiny"})
    assert by_name[0] == by_path[0] == 200
    text = [json.loads(raw)["choices"][0]["text"] for _, raw in (by_name, by_path)]
    assert text[0] == text[1]
