"""Attention with per-head sinks and a sliding window (layers/sink_attention.py, and the decode step's sinks in
layers/attention.py) equals a hand-written float32 softmax: each query and head, its visible keys' logits and the
sink's, exp over their sum, the keys' shares weighing the values. Prefill in one pass, in chunks that continue a
cached sequence across the window's edge, in blocks of queries, and decode steps over the paged cache."""

import math

import pytest
import torch

from hybridmoe.forward_context import Context, use_context
from hybridmoe.layers import sink_attention
from hybridmoe.layers.attention import KVCache, cached_attention, contiguous_slot_table
from hybridmoe.layers.sink_attention import attend_with_sinks

HQ, HKV, D = 4, 2, 8
SCALE = D ** -0.5


def ref_attention(q, k, v, q_start, sinks, window):
    """q [n, Hq, D], k/v [m, Hkv, D] (positions 0..m-1), sinks [Hq] or None -> [n, Hq, D], one query and head at
    a time."""
    n, m = q.shape[0], k.shape[0]
    out = torch.zeros(n, HQ, D)
    for i in range(n):
        pos = q_start + i
        keys = [j for j in range(m) if j <= pos and (window is None or j > pos - window)]
        for h in range(HQ):
            kv = h // (HQ // HKV)
            logits = [float(q[i, h] @ k[j, kv]) * SCALE for j in keys]
            extra = [float(sinks[h])] if sinks is not None else []
            top = max(logits + extra)
            total = sum(math.exp(x - top) for x in logits + extra)
            for j, x in zip(keys, logits):
                out[i, h] += math.exp(x - top) / total * v[j, kv]
    return out


def qkv(n, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, HQ, D, generator=g), torch.randn(n, HKV, D, generator=g),
            torch.randn(n, HKV, D, generator=g), 2 * torch.randn(HQ, generator=g))


@pytest.mark.parametrize("window", [None, 3, 8])
@pytest.mark.parametrize("q_start", [0, 5])
def test_prefill_equals_the_reference(window, q_start):
    q, k, v, sinks = qkv(12, seed=q_start + (window or 0))
    ours = attend_with_sinks(q[q_start:], k, v, q_start, SCALE, sinks, window)
    torch.testing.assert_close(ours, ref_attention(q[q_start:], k, v, q_start, sinks, window), atol=1e-5, rtol=1e-5)


def test_the_sinks_change_the_output():
    """The reference without sinks differs: a test that ignored them would fail."""
    q, k, v, sinks = qkv(6, seed=1)
    ours = attend_with_sinks(q, k, v, 0, SCALE, sinks, 3)
    assert not torch.allclose(ours, ref_attention(q, k, v, 0, None, 3), atol=1e-3)


@pytest.mark.parametrize("window", [None, 3])
def test_queries_in_blocks_equal_one_block(window, monkeypatch):
    q, k, v, sinks = qkv(17, seed=2)
    whole = attend_with_sinks(q, k, v, 0, SCALE, sinks, window)
    monkeypatch.setattr(sink_attention, "SINK_BLOCK_SCORES", HQ * 2 * 6)  # blocks of 2 (window) or 1 query
    assert sink_attention._query_rows(HQ, 17, window) < 3
    torch.testing.assert_close(attend_with_sinks(q, k, v, 0, SCALE, sinks, window), whole, atol=1e-6, rtol=1e-6)


def step(q, k, v, cache, slots, start_pos, lens, sinks, window):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    with use_context(Context(slot_ids=slots, start_pos=start_pos, cu_seqlens=cu)):
        return cached_attention(q, k, v, cache, SCALE, window, sinks)


@pytest.mark.parametrize("window", [None, 4])
def test_chunks_and_decode_steps_over_the_paged_cache_equal_the_reference(window):
    """Two sequences in slots 1 and 0, prefilled together in chunks of 3 then 6 tokens and of 2 then 5 (the second
    chunks cross the window's edge), then decoded together at different lengths."""
    seqs = [qkv(14, seed=10), qkv(11, seed=11)]
    sinks = seqs[0][3]
    cache = KVCache(8, 4, HKV, D, D, torch.float32, torch.device("cpu"), contiguous_slot_table(2, 16, 4, "cpu"))
    refs = [ref_attention(q, k, v, 0, sinks, window) for q, k, v, _ in seqs]
    done = [0, 0]
    for chunks in ((3, 2), (6, 5)):  # prefill both sequences, batched, chunk by chunk
        parts = [tuple(t[p:p + n] for t in s[:3]) for s, p, n in zip(seqs, done, chunks)]
        out = step(*(torch.cat(t) for t in zip(*parts)), cache, [1, 0], list(done), list(chunks), sinks, window)
        torch.testing.assert_close(out, torch.cat([refs[b][p:p + n] for b, (p, n) in enumerate(zip(done, chunks))]),
                                   atol=1e-5, rtol=1e-5)
        done = [p + n for p, n in zip(done, chunks)]
    while done[1] < 11:  # one token each per step
        out = step(*(torch.cat([s[i][p:p + 1] for s, p in zip(seqs, done)]) for i in range(3)), cache, [1, 0],
                   list(done), [1, 1], sinks, window)
        for b, p in enumerate(done):
            torch.testing.assert_close(out[b], refs[b][p], atol=1e-5, rtol=1e-5)
        done = [p + 1 for p in done]
