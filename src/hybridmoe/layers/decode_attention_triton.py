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

from hybridmoe.layers.rope_triton import norm_rope_heads


@triton.jit
def _attend(q, k_ptr, v_ptr, base, first, end, scale, stride_cl, D, PRECISION: tl.constexpr,
            BLOCK_G: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
    """q [BLOCK_G, BLOCK_D] over the cached keys/values at positions [first, end) from base -> the online
    softmax's (max [BLOCK_G], total [BLOCK_G], unnormalized sum [BLOCK_G, BLOCK_D]), float32; no key:
    (-inf, 0, 0)."""
    d = tl.arange(0, BLOCK_D)
    m = tl.full((BLOCK_G,), -float("inf"), dtype=tl.float32)
    total = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    # blocks from the one holding the first visible key: each holds at least one, so m stays finite
    for l0 in range(first // BLOCK_L * BLOCK_L, tl.where(first < end, end, 0), BLOCK_L):
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
    return m, total, acc


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
    m, total, acc = _attend(q, k_ptr, v_ptr, base, first, end, scale, stride_cl, D, PRECISION,
                            BLOCK_G, BLOCK_L, BLOCK_D)
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
def _rope_attention_kernel(qkv_ptr, k_ptr, v_ptr, q_w_ptr, k_w_ptr, positions_ptr, inv_freq_ptr, tslot_ptr, tpos_ptr,
                           slot_ptr, len_ptr, out_ptr, rope_scaling, eps, scale, window, G, D, Hq, Hkv,
                           stride_t, stride_cs, stride_cl, stride_ch,
                           HAS_NORM: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
                           BLOCK_G: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (b, kh): row b's new token from the merged projection qkv [B, (Hq + 2 Hkv) D]: its G query
    heads of key/value head kh and that key head normalized and rotated (rope_triton.norm_rope_heads), the
    key and value written to the cache at (tslot[b], tpos[b]); then the queries over the cached keys
    before it (visible ones) and, last, over the new key, held in registers -> out [B, Hq, D]."""
    b = tl.program_id(0)
    kh = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    half = D // 2
    cols = d[None, :]
    inside = cols < D
    right = cols >= half
    partner = tl.where(right, cols - half, cols + half)
    heads = kh * G + g
    q_mask = (g < G)[:, None] & inside
    row = qkv_ptr + b * stride_t
    angle = tl.load(positions_ptr + b).to(tl.float32) * tl.load(inv_freq_ptr + cols % half, mask=inside, other=0.0)
    x = tl.load(row + heads[:, None] * D + cols, mask=q_mask, other=0.0)
    xp = tl.load(row + heads[:, None] * D + partner, mask=q_mask, other=0.0)
    w, wp = x, xp  # read only with a norm
    if HAS_NORM:
        w = tl.load(q_w_ptr + cols, mask=inside, other=0.0)
        wp = tl.load(q_w_ptr + partner, mask=inside, other=0.0)
    q = norm_rope_heads(x, xp, w, wp, angle, right, rope_scaling, eps, D, HAS_NORM)  # [BLOCK_G, BLOCK_D]
    x = tl.load(row + (Hq + kh) * D + cols, mask=inside, other=0.0)
    xp = tl.load(row + (Hq + kh) * D + partner, mask=inside, other=0.0)
    if HAS_NORM:
        w = tl.load(k_w_ptr + cols, mask=inside, other=0.0)
        wp = tl.load(k_w_ptr + partner, mask=inside, other=0.0)
    k = norm_rope_heads(x, xp, w, wp, angle, right, rope_scaling, eps, D, HAS_NORM).to(k_ptr.dtype.element_ty)
    v = tl.load(row + (Hq + Hkv + kh) * D + cols, mask=inside, other=0.0).to(v_ptr.dtype.element_ty)  # [1, BLOCK_D]
    at = tl.load(tslot_ptr + b).to(tl.int64) * stride_cs + tl.load(tpos_ptr + b).to(tl.int64) * stride_cl + kh * stride_ch
    tl.store(k_ptr + at + cols, k, mask=inside)
    tl.store(v_ptr + at + cols, v, mask=inside)
    n = tl.load(len_ptr + b)  # the row's keys: positions 0 .. n - 1, its new token at n - 1
    first = n * 0
    if HAS_WINDOW:
        first = tl.maximum(first, n - window)  # keys > (n - 1) - window
    base = tl.load(slot_ptr + b).to(tl.int64) * stride_cs + kh * stride_ch
    m, total, acc = _attend(q, k_ptr, v_ptr, base, first, n - 1, scale, stride_cl, D, PRECISION,
                            BLOCK_G, BLOCK_L, BLOCK_D)
    s = tl.sum(q.to(tl.float32) * k.to(tl.float32), axis=1) * scale  # [BLOCK_G] the new key's scores
    m_new = tl.maximum(m, s)
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new)
    total = total * alpha + p
    acc = acc * alpha[:, None] + p.to(v.dtype).to(tl.float32)[:, None] * v.to(tl.float32)
    tl.store(out_ptr + (b * Hq + heads[:, None]) * D + cols, (acc / total[:, None]).to(out_ptr.dtype.element_ty),
             mask=q_mask)


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


def triton_rope_decode_attention(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                                 q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                                 positions: torch.Tensor, inv_freq: torch.Tensor, rope_scaling: float,
                                 k_cache: torch.Tensor, v_cache: torch.Tensor, token_slot: torch.Tensor,
                                 token_pos: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, scale: float,
                                 sliding_window: int | None) -> torch.Tensor:
    """A decode step's rope_triton.triton_norm_rope_cache then triton_decode_attention in one kernel, for
    caches of at most CHUNK positions (max_len <= CHUNK: one program per (row, key/value head) reads it all).

    qkv [B, (Hq + 2 Hkv) D], one new token per row b at positions[b], its key and value written at
    (token_slot[b], token_pos[b]) of k_cache, v_cache [S, L, Hkv, D]; slots, lens: the rows' slots and
    lengths with the new token (its position lens[b] - 1 = token_pos[b]) -> [B, Hq, D].
    """
    B = qkv.shape[0]
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    out = torch.empty(B, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    G = num_heads // num_kv_heads
    has_norm = q_weight is not None
    _rope_attention_kernel[(B, num_kv_heads)](
        qkv, k_cache, v_cache, q_weight if has_norm else qkv, k_weight if has_norm else qkv, positions, inv_freq,
        token_slot, token_pos, slots, lens, out, rope_scaling, eps, scale, sliding_window or 0, G, head_dim,
        num_heads, num_kv_heads, qkv.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HAS_NORM=has_norm, HAS_WINDOW=sliding_window is not None,
        PRECISION="ieee" if qkv.dtype == torch.float32 else "tf32", BLOCK_G=max(16, triton.next_power_of_2(G)),
        BLOCK_L=64, BLOCK_D=max(16, triton.next_power_of_2(head_dim)))
    return out
