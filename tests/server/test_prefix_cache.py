"""Prefix caching over HTTP: a conversation re-sent with a new turn finds its earlier blocks, the response's
usage.prompt_tokens_details.cached_tokens says how many prompt tokens came from the cache, and /metrics counts
lookups, hits and the hit rate."""

import uuid


def conversation(turns: int, system: str) -> list[dict]:
    messages = [{"role": "system", "content": system}]
    for i in range(turns):
        messages += [{"role": "user", "content": f"question {i}: what comes next?"},
                     {"role": "assistant", "content": f"answer {i}"}]
    return messages + [{"role": "user", "content": "and now?"}]


def test_a_re_sent_conversation_reports_its_cached_prompt_tokens(server):
    client = server.client()
    system = f"You are a careful assistant {uuid.uuid4().hex}. " * 3  # a prefix no other test sends
    queries, hits = server.metric("prefix_cache_queries_total"), server.metric("prefix_cache_hits_total")
    first = client.chat.completions.create(model="tiny", messages=conversation(0, system), max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.chat.completions.create(model="tiny", messages=conversation(2, system), max_tokens=2)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # the system message's full blocks (64 tokens each) come back; the new turns do not
    assert 64 <= cached < second.usage.prompt_tokens and cached % 64 == 0
    assert first.usage.prompt_tokens > cached - 64
    assert server.metric("prefix_cache_queries_total") - queries == first.usage.prompt_tokens + \
        second.usage.prompt_tokens
    assert server.metric("prefix_cache_hits_total") - hits == cached
    assert 0 < server.metric("prefix_cache_hit_rate") <= 1
    # streamed, with usage: the same conversation again finds at least as much
    chunks = list(client.chat.completions.create(model="tiny", messages=conversation(2, system), max_tokens=2,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= cached
