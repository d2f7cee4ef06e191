"""/v1/completions through the official openai client: text and token-id prompts, batches of
prompts, streaming that adds up to the answer, echo, stop strings, usage."""

import pytest

GREEDY = {"model": "tiny", "temperature": 0, "max_tokens": 20, "extra_body": {"ignore_eos": True}}


def test_completion_answer_and_usage(server):
    r = server.client().completions.create(prompt="The experts live on the CPU", **GREEDY)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 20
    assert r.usage.total_tokens == r.usage.prompt_tokens + 20


def test_token_id_prompt_equals_text_prompt(server, tiny_qwen3_fp32):
    from hybridmoe.tokenizer import Tokenizer

    client = server.client()
    text = "The experts live on the CPU"
    ids = Tokenizer.from_dir(tiny_qwen3_fp32).encode(text)
    by_text = client.completions.create(prompt=text, **GREEDY)
    by_ids = client.completions.create(prompt=ids, **GREEDY)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_batch_of_prompts_keeps_order(server):
    client = server.client()
    prompts = ["first prompt", "a second, longer prompt here", "third"]
    alone = [client.completions.create(prompt=p, **GREEDY).choices[0].text for p in prompts]
    batch = client.completions.create(prompt=prompts, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == alone
    assert batch.usage.completion_tokens == 60


def test_stream_adds_up_to_the_answer(server):
    client = server.client()
    whole = client.completions.create(prompt="Streams of tokens", **GREEDY)
    events = list(client.completions.create(prompt="Streams of tokens", stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(e.choices[0].text for e in events if e.choices) == whole.choices[0].text
    assert [e.choices[0].finish_reason for e in events if e.choices][-1] == "length"
    assert events[-1].usage.model_dump() == whole.usage.model_dump()


def test_echo_puts_the_prompt_first(server):
    client = server.client()
    plain = client.completions.create(prompt="Echo me", **GREEDY).choices[0].text
    echoed = client.completions.create(prompt="Echo me", echo=True, **GREEDY).choices[0].text
    assert echoed == "Echo me" + plain


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(server, stream):
    client = server.client()
    full = client.completions.create(prompt="Stop strings", **{**GREEDY, "max_tokens": 40}).choices[0].text
    stop = full[8:11]
    r = client.completions.create(prompt="Stop strings", stop=stop, stream=stream, **{**GREEDY, "max_tokens": 40})
    choices = [e.choices[0] for e in r if e.choices] if stream else r.choices
    assert "".join(c.text for c in choices) == full[:full.index(stop)]
    assert choices[-1].finish_reason == "stop"
