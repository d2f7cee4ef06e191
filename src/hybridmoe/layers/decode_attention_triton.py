"""Decode attention (one new token per sequence) over the slot KV cache, as one Triton kernel.

torch gathers every row's cache up to the padded length, builds the mask and runs SDPA: ~8 kernels
per layer, each with its launch and drain in a decode step's CUDA graph. Here one program per
(sequence, key/value head, chunk of CHUNK positions) takes that head's G = Hq / Hkv query heads
together and walks the chunk from its oldest visible key to the row's length (read at run time,
so a replayed graph reads no more than the row holds), with an online softmax in float32;
probabilities are rounded to the cache dtype before they weigh the values, as flash attention
does. Up to CHUNK positions that is the one kernel; a longer cache adds a second that combines
the chunks (flash-decoding).

B sequences, Hq query heads, Hkv key/value heads, D head dim, S slots, L cached positions, NC chunks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, slot_ptr, len_ptr, out_ptr, m_ptr, l_ptr, scale, window, G, D,
                             stride_qb, stride_qh, stride_cs, stride_cl, stride_ch, CHUNK,
                             HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
                             BLOCK_G: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (b, kh, c): row b's query heads of key/value head kh over the visible keys of positions
    [c * CHUNK, (c + 1) * CHUNK). SPLIT: the unnormalized sum and its (max, total) go to out, m, l
    [B, Hq, NC(, D)] for _combine_kernel; else the normalized output to out [B, Hq, D]."""
    b = tl.program_id(0)
    kh = tl.program_id(1)
    c = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kh * G + g
    q_mask = (g < G)[:, None] & (d < D)[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    n = tl.load(len_ptr + b)  # the row's keys: positions 0 .. n - 1, its new token at n - 1
    first = c * CHUNK
    if HAS_WINDOW:
        first = tl.maximum(first, n - window)  # keys > (n - 1) - window
    end = tl.minimum(n, (c + 1) * CHUNK)
    base = tl.load(slot_ptr + b).to(tl.int64) * stride_cs + kh * stride_ch
    m = tl.full((BLOCK_G,), -float("inf"), dtype=tl.float32)
    total = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    # blocks from the one holding the first visible key: each holds at least one, so m stays finite;
    # a chunk with none leaves (m, total, acc) = (-inf, 0, 0)
    for l0 in range(first // BLOCK_L * BLOCK_L, end, BLOCK_L):
        pos = l0 + tl.arange(0, BLOCK_L)
        kv_mask = (pos < end)[:, None] & (d < D)[None, :]
        k = tl.load(k_ptr + base + pos[:, None] * stride_cl + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_G, BLOCK_L]
        s = tl.where(((pos >= first) & (pos < end))[None, :], s, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + base + pos[:, None] * stride_cl + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    if SPLIT:
        NC = tl.num_programs(2)
        part = (b * G * tl.num_programs(1) + heads) * NC + c  # [BLOCK_G] index into [B, Hq, NC]
        tl.store(m_ptr + part, m, mask=g < G)
        tl.store(l_ptr + part, total, mask=g < G)
        tl.store(out_ptr + part[:, None] * D + d[None, :], acc, mask=q_mask)
    else:
        tl.store(out_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                 (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _combine_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, NC, D, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (b, h): the chunks' partial softmax sums of one query head -> its output row."""
    row = tl.program_id(0)  # b * Hq + h
    c = tl.arange(0, BLOCK_C)
    d = tl.arange(0, BLOCK_D)
    m = tl.load(m_ptr + row * NC + c, mask=c < NC, other=-float("inf"))
    scale = tl.exp(m - tl.max(m, axis=0))  # chunks with no key (-inf) weigh 0
    total = tl.sum(tl.load(l_ptr + row * NC + c, mask=c < NC, other=0.0) * scale, axis=0)
    acc = tl.load(acc_ptr + (row * NC + c)[:, None] * D + d[None, :], mask=(c < NC)[:, None] & (d < D)[None, :],
                  other=0.0)
    out = tl.sum(acc * scale[:, None], axis=0) / total
    tl.store(out_ptr + row * D + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


CHUNK = 512
"""Positions per program: a row's cache longer than this is split into chunks run side by side (each
(row, key/value head) is one program otherwise, too few to read a long cache fast), then combined."""


def triton_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                            lens: torch.Tensor, scale: float, sliding_window: int | None,
                            max_len: int) -> torch.Tensor:
    """q [B, Hq, D] (row b's new token) over k_cache, v_cache [S, L, Hkv, D] slot slots[b], positions
    0 .. lens[b] - 1 (within the window, if any) -> [B, Hq, D]. max_len: a bound on lens (known on
    the host: the padded length of a fixed-shape step), which sets the chunks."""
    B, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    q = q.contiguous()
    out = torch.empty_like(q)
    G = Hq // Hkv
    NC = triton.cdiv(max_len, CHUNK)
    blocks = dict(BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_L=64, BLOCK_D=max(16, triton.next_power_of_2(D)))
    args = (scale, sliding_window or 0, G, D, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), CHUNK)
    flags = dict(HAS_WINDOW=sliding_window is not None, PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    if NC == 1:
        _decode_attention_kernel[(B, Hkv, 1)](q, k_cache, v_cache, slots, lens, out, out, out, *args, SPLIT=False,
                                             **flags, **blocks)
        return out
    acc = torch.empty(B, Hq, NC, D, dtype=torch.float32, device=q.device)
    m = torch.empty(B, Hq, NC, dtype=torch.float32, device=q.device)
    total = torch.empty_like(m)
    _decode_attention_kernel[(B, Hkv, NC)](q, k_cache, v_cache, slots, lens, acc, m, total, *args, SPLIT=True,
                                          **flags, **blocks)
    _combine_kernel[(B * Hq,)](acc, m, total, out, NC, D, BLOCK_C=max(2, triton.next_power_of_2(NC)),
                               BLOCK_D=blocks["BLOCK_D"])
    return out
