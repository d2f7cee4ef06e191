"""Property-based fuzz of the request schemas against a real server: bodies built from the schemas' fields with
values of any JSON type and size (huge and tiny numbers, long and odd strings, nested lists) get an answer, a
400 or a 422, never a 500 or a dropped connection, and a well-formed request sent beside the last body still
gets its solo answer. Bounded: a few dozen bodies per route, each asking for a few tokens at most."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SAMPLING = ["model", "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "stream", "logprobs",
            "max_tokens"]
NUMBERS = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([0, 1, -1, 2**31, 2**63, 10**30, 5e-324, 1e-40,
                                                                   1e300, -0.0, 0.5, 2.0, 100.0]),
                    st.floats(allow_nan=False, allow_infinity=False))
TEXT = st.one_of(st.text(max_size=40), st.sampled_from(["", "\x00", "a\ud800b", "\U0001f600" * 10, "x" * 5000]))
LEAF = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
VALUE = st.recursive(LEAF, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=3),
                     max_leaves=12)
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def bounded(body: dict) -> dict:
    """Every body asks for a few tokens at most, whatever else it holds (a valid one then answers quickly)."""
    if isinstance(body.get("max_tokens"), int) and 0 < body["max_tokens"] < 10**9:
        body["max_tokens"] = min(body["max_tokens"], 4)
    elif "max_tokens" not in body:
        body["max_tokens"] = 4
    if isinstance(body.get("n"), int) and 0 < body["n"] < 10**9:
        body["n"] = min(body["n"], 2)
    return body


def sent(server, path: str, body: dict) -> int:
    code, raw = server.post(path, json.dumps(body, allow_nan=False).encode())
    assert code in (200, 400, 413, 422), (code, raw[:300], body)
    if code != 200:
        assert json.loads(raw)["error"]["message"]
    return code


@FUZZ
@given(fields=st.dictionaries(st.sampled_from(SAMPLING), VALUE, max_size=6), prompt=st.one_of(TEXT, VALUE))
def test_completion_bodies(server, fields, prompt):
    sent(server, "/v1/completions", bounded({**fields, "prompt": prompt}))


@FUZZ
@given(fields=st.dictionaries(st.sampled_from(SAMPLING), VALUE, max_size=6),
       messages=st.one_of(VALUE, st.lists(st.fixed_dictionaries(
           {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"])},
           optional={"content": st.one_of(TEXT, VALUE), "name": VALUE}), max_size=4)))
def test_chat_bodies(server, fields, messages):
    sent(server, "/v1/chat/completions", bounded({**fields, "messages": messages}))


def test_the_server_answers_well_formed_requests_after_the_fuzz(server):
    server.alongside(lambda: sent(server, "/v1/completions", {"prompt": [1, 2], "stop": ["x"] * 65}))
