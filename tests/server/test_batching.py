"""Continuous batching through the server: 8 concurrent greedy requests each return exactly what
they return alone, and the engine really ran them together (the batch-size histogram)."""

from concurrent.futures import ThreadPoolExecutor

PROMPTS = [f"Request number {i} asks about mixture of experts" + " and more" * i for i in range(8)]


def _complete(server, prompt, stream):
    kwargs = dict(model="tiny", prompt=prompt, temperature=0, max_tokens=32, extra_body={"ignore_eos": True})
    client = server.client()
    if stream:
        return "".join(e.choices[0].text for e in client.completions.create(stream=True, **kwargs) if e.choices)
    return client.completions.create(**kwargs).choices[0].text


def test_concurrent_requests_equal_their_solo_results(server):
    alone = [_complete(server, p, stream=False) for p in PROMPTS]
    batched_steps = server.metric("batch_size_count") - server.metric("batch_size_bucket", 'le="1"')
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        # half of them streaming: both kinds share the same engine steps
        together = list(pool.map(lambda ip: _complete(server, ip[1], stream=ip[0] % 2 == 1), enumerate(PROMPTS)))
    assert together == alone
    # steps that sampled more than one sequence: the requests did share steps
    assert server.metric("batch_size_count") - server.metric("batch_size_bucket", 'le="1"') > batched_steps
