"""Decode attention (one new token per sequence) over the slot KV cache, as one Triton kernel.

torch gathers every row's cache up to the padded length, builds the mask and runs SDPA: ~8 kernels
per layer, each with its launch and drain in a decode step's CUDA graph. Here one program per
(sequence, key/value head) takes that head's G = Hq / Hkv query heads together and walks its
cache from the oldest visible key to the row's length (read at run time, so a replayed graph
reads no more than the row holds), with an online softmax in float32; probabilities are rounded
to the cache dtype before they weigh the values, as flash attention does.

B sequences, Hq query heads, Hkv key/value heads, D head dim, S slots, L cached positions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, slot_ptr, len_ptr, out_ptr, scale, window, G, D,
                             stride_qb, stride_qh, stride_cs, stride_cl, stride_ch,
                             HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
                             BLOCK_G: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kh * G + g
    q_mask = (g < G)[:, None] & (d < D)[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    n = tl.load(len_ptr + b)  # the row's keys: positions 0 .. n - 1, its new token at n - 1
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(n - window, 0)  # keys > (n - 1) - window
    base = tl.load(slot_ptr + b).to(tl.int64) * stride_cs + kh * stride_ch
    m = tl.full((BLOCK_G,), -float("inf"), dtype=tl.float32)
    total = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    # blocks from the one holding the first visible key: each holds at least one, so m stays finite
    for l0 in range(first // BLOCK_L * BLOCK_L, n, BLOCK_L):
        pos = l0 + tl.arange(0, BLOCK_L)
        kv_mask = (pos < n)[:, None] & (d < D)[None, :]
        k = tl.load(k_ptr + base + pos[:, None] * stride_cl + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_G, BLOCK_L]
        s = tl.where(((pos >= first) & (pos < n))[None, :], s, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + base + pos[:, None] * stride_cl + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    out = acc / total[:, None]
    tl.store(out_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=q_mask)


def triton_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                            lens: torch.Tensor, scale: float, sliding_window: int | None) -> torch.Tensor:
    """q [B, Hq, D] (row b's new token) over k_cache, v_cache [S, L, Hkv, D] slot slots[b], positions
    0 .. lens[b] - 1 (within the window, if any) -> [B, Hq, D]."""
    B, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    q = q.contiguous()
    out = torch.empty_like(q)
    G = Hq // Hkv
    _decode_attention_kernel[(B, Hkv)](
        q, k_cache, v_cache, slots, lens, out, scale, sliding_window or 0, G, D, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), HAS_WINDOW=sliding_window is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_L=64, BLOCK_D=max(16, triton.next_power_of_2(D)))
    return out
