"""Decode attention with the q/k norms, rotary and cache writes inside (decode_attention_triton.py
triton_rope_decode_attention, one kernel) against the two kernels it replaces and against the torch
ops (Attention unfused): the same outputs and caches. Rows of length 1 (the new key alone), a window,
caches up to CHUNK positions, paged through a shuffled block table; float32 and bfloat16. Runs on the
GPU host.

B sequences, Hq query heads, Hkv key/value heads, D head dim, S slots, NB blocks of BS positions, M blocks
per slot.
"""

import pytest
import torch

from hybridmoe.forward_context import Context, DecodeBatch, use_context
from hybridmoe.layers.attention import Attention

pytestmark = [pytest.mark.device,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
BS = 64


def shuffled_table(num_slots: int, max_len: int, seed: int = 0) -> torch.Tensor:
    """[S, M] int32 on CUDA: each slot's max_len positions in blocks of BS taken in a shuffled order from
    1 .. S * M (block 0: scratch)."""
    per_slot = -(-max_len // BS)
    order = torch.randperm(num_slots * per_slot, generator=torch.Generator().manual_seed(seed)) + 1
    return order.view(num_slots, per_slot).to("cuda", torch.int32)


def token_rows(table: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """The flat cache rows (block * BS + offset) of each row's new token, at position lens - 1."""
    pos = lens - 1
    return table[slots, pos // BS].long() * BS + pos % BS


def seeded_attention(hidden: int, head_dim: int, qk_norm: bool, window: int | None, dtype: torch.dtype) -> Attention:
    """Attention of 8 query and 2 key/value heads on CUDA, made after torch.manual_seed(0) (the same weights
    each time); with qk_norm, its q/k norms' weights moved off 1. No cache yet."""
    torch.manual_seed(0)
    a = Attention(hidden, 8, 2, head_dim, {"rope_type": "default", "rope_theta": 1e6},
                  qk_norm_eps=1e-6 if qk_norm else None, sliding_window=window).to("cuda", dtype)
    if qk_norm:
        with torch.no_grad():
            a.q_norm.weight.add_(0.1 * torch.randn(head_dim, device="cuda"))
            a.k_norm.weight.add_(0.1 * torch.randn(head_dim, device="cuda"))
    return a


def attention(qk_norm: bool, window: int | None, dtype: torch.dtype, table: torch.Tensor) -> Attention:
    a = seeded_attention(512, 128, qk_norm, window, dtype)
    a.allocate_kv_cache(table.numel() + 1, BS)
    with torch.no_grad():  # a cache already written up to each row's new token
        a.kv_cache.k.normal_()
        a.kv_cache.v.normal_()
    return a


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm,window", [(True, None), (False, None), (True, 5)])
@pytest.mark.parametrize("lens", [[1, 1], [5, 64], [512, 300, 2]])
def test_rope_inside_decode_attention_equals_the_two_kernels_and_torch(lens, qk_norm, window, dtype):
    from hybridmoe.layers.decode_attention_triton import (
        triton_decode_attention,
        triton_rope_decode_attention,
    )
    from hybridmoe.layers.rope_triton import triton_norm_rope_cache

    table = shuffled_table(4, 512)
    a = attention(qk_norm, window, dtype, table)
    B = len(lens)
    slots = torch.tensor([3, 0, 2][:B], device="cuda")
    lens_t = torch.tensor(lens, device="cuda")
    positions = lens_t - 1
    rows = token_rows(table, slots, lens_t)
    x = torch.randn(B, 512, generator=torch.Generator().manual_seed(B)).to("cuda", dtype)
    qkv = a.qkv_proj(x)
    rope = (a.q_norm.weight if qk_norm else None, a.k_norm.weight if qk_norm else None,
            a.q_norm.eps if qk_norm else 0.0, positions, a.rotary.inv_freq(qkv.device), a.rotary.attention_scaling)
    k0, v0 = a.kv_cache.k.clone(), a.kv_cache.v.clone()
    k1, v1 = k0.clone(), v0.clone()
    got = triton_rope_decode_attention(qkv, 8, 2, 128, *rope, k1, v1, rows, table, slots, lens_t, a.scale, window)
    k2, v2 = k0.clone(), v0.clone()
    q = triton_norm_rope_cache(qkv, 8, 2, 128, *rope, k2, v2, rows)
    two = triton_decode_attention(q, k2, v2, table, slots, lens_t, a.scale, window, 512)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)
    torch.testing.assert_close(got, two, **TOL[dtype])
    a.fused = a.fused_layer = False  # the torch ops
    ctx = Context(slot_ids=[], start_pos=[], cu_seqlens=[0], decode=DecodeBatch(slots, lens_t, 512), block_table=table)
    with use_context(ctx):
        want = a(x, positions)
    torch.testing.assert_close(a.o_proj(got.reshape(B, -1)), want, **TOL[dtype])
    torch.testing.assert_close(k1, a.kv_cache.k, **TOL[dtype])
    assert torch.equal(v1, a.kv_cache.v)


def test_attention_takes_the_one_kernel_up_to_chunk_positions_only():
    """fused_layer on: a decode step over at most CHUNK cached positions runs the one kernel, a longer
    one the two; both equal the module with fused_layer off."""
    from hybridmoe.layers.decode_attention_triton import CHUNK

    for max_len in (CHUNK, 2 * CHUNK):
        table = shuffled_table(4, max_len, seed=max_len)
        outs = []
        for layer in (True, False):
            a = attention(True, None, torch.float32, table)
            a.fused_layer = layer
            slots, lens = torch.tensor([1, 2], device="cuda"), torch.tensor([CHUNK - 3, 9], device="cuda")
            x = torch.randn(2, 512, generator=torch.Generator().manual_seed(0)).to("cuda")
            ctx = Context(slot_ids=[], start_pos=[], cu_seqlens=[0], decode=DecodeBatch(slots, lens, max_len),
                          block_table=table)
            with use_context(ctx):
                outs.append((a(x, lens - 1), a.kv_cache.k, a.kv_cache.v))
        for got, want in zip(*outs):
            torch.testing.assert_close(got, want, **TOL[torch.float32])
