"""/v1/chat/completions through the official openai client: answers, streams that add up to the
same answer, usage numbers, stop strings, n choices and seeds."""

GREEDY = {"temperature": 0, "max_tokens": 24}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about experts."}]


def _stream_text(client, **kwargs):
    """(text of each choice, finish reasons, usage, raw chunks) of a streamed chat completion."""
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    texts, reasons, usage = {}, {}, None
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
        usage = c.usage or usage
    return texts, reasons, usage, chunks


def test_chat_answer_and_usage(server):
    client = server.client()
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, **GREEDY)
    assert r.object == "chat.completion" and r.model == "tiny" and len(r.choices) == 1
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    # usage: the prompt is the chat template's tokens; the completion is what was generated
    assert r.usage.prompt_tokens > 10
    assert 1 <= r.usage.completion_tokens <= 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_adds_up_to_the_answer(server):
    client = server.client()
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, **GREEDY)
    texts, reasons, usage, chunks = _stream_text(
        client, model="tiny", messages=MESSAGES, stream_options={"include_usage": True}, **GREEDY)
    assert texts == {0: whole.choices[0].message.content}
    assert reasons == {0: whole.choices[0].finish_reason}
    assert usage.model_dump() == whole.usage.model_dump()
    # OpenAI's framing: role first, one id for the whole stream, the usage chunk last without choices
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])


def test_chat_stop_string_cuts_the_answer(server):
    client = server.client()
    full = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=40,
                                          extra_body={"ignore_eos": True}).choices[0].message.content
    stop = full[10:13]
    expected = full[:full.index(stop)]
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=40, stop=[stop],
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    texts, reasons, _, _ = _stream_text(client, model="tiny", messages=MESSAGES, temperature=0, max_tokens=40,
                                        stop=stop, extra_body={"ignore_eos": True})
    assert texts == {0: expected} and reasons == {0: "stop"}


def test_max_tokens_ends_with_length(server):
    r = server.client().chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                                max_completion_tokens=5, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5


def test_n_choices_and_seeds(server):
    client = server.client()
    kwargs = dict(model="tiny", messages=MESSAGES, temperature=1.0, max_tokens=16, seed=1234,
                  extra_body={"ignore_eos": True})
    a = client.chat.completions.create(n=3, **kwargs)
    b = client.chat.completions.create(n=3, **kwargs)
    texts = [c.message.content for c in a.choices]
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in b.choices]  # same seed, same answers
    assert len(set(texts)) == 3  # each choice draws from its own seed
    assert a.usage.completion_tokens == 3 * 16
    streamed, reasons, _, _ = _stream_text(client, n=3, **kwargs)
    assert streamed == dict(enumerate(texts)) and reasons == {0: "length", 1: "length", 2: "length"}


def test_text_content_parts_are_joined(server):
    client = server.client()
    parts = [{"role": "user", "content": [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "more."}]}]
    plain = [{"role": "user", "content": "Tell me more."}]
    a = client.chat.completions.create(model="tiny", messages=parts, **GREEDY)
    b = client.chat.completions.create(model="tiny", messages=plain, **GREEDY)
    assert a.choices[0].message.content == b.choices[0].message.content
