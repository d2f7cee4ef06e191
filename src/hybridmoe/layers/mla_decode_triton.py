"""A decode step of multi-head latent attention (layers/mla.py) over its paged latent cache, in Triton.

torch runs it as ~25 kernels per layer: cos/sin, the two rotaries (slices, products, cat), the latent's
RMSNorm, the cat of the cache row and its write, the gather of every row's cache up to the padded length,
two matmuls, the mask, the softmax and its casts. Here one program per (block of BLOCK_H heads, chunk of
positions, row) rotates the heads' q_pe and attends over the chunk's cached positions with an online
softmax in float32 (flash-decoding: a long cache is cut into chunks run side by side, so a long decode
runs on every SM rather than on a few programs per row; a second kernel, decode_attention_triton's
combine_chunks, merges the chunks' partial sums; a cache of one chunk needs only the first). The chunk holding the new token (position lens[b] - 1)
makes its cache row in registers (the normalized latent c and the rotated k_pe, every rounding of the
torch ops kept): its head block 0 writes the row into the cache, and its programs weigh the new key from
registers last. No program reads that row from the cache, so the write needs no ordering against the reads
and no launch of its own (decode runs in CUDA graphs, where each launch costs). Probabilities are rounded
to the cache dtype (a float8 cache: the queries') before they weigh the latents, as flash attention does;
scores stay float32 (torch rounds them to the model dtype first).

The cache is paged: position p of the sequence in slot s is at block block_table[s, p // BS], row p % BS.
Positions are read in tiles of BLOCK_L, a divisor of BS, so a tile lies in one block: one block-table read
per tile, and the tile's rows are consecutive as in an unpaged cache.

A float8 cache (layers/kv_quant.py: e4m3 codes, a float32 scale per position in kv_scale [NB, BS, 1]) is read
in place: each tile's codes are widened to float32, times their rows' scales, and rounded to the queries' dtype
(kv_quant.read_positions' values); the new row is quantized as kv_quant.quantize_rows does (the same codes and
scale) and weighs in dequantized, as it will when read from the cache. Without a scale (QUANT off) that code is
not compiled.

B rows (one new token each), N heads, R kv_lora_rank, P qk_rope_head_dim (pairs rotated: P / 2), NB blocks of
BS positions, S slots, M blocks per slot's table, NC chunks. Cache rows: [c (R) | rotated k_pe, first elements
of each pair (P / 2) | second (P / 2)].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridmoe.layers.decode_attention_triton import (
    check_fp8_scales,
    combine_chunks,
    fp8_codes,
    fp8_scale,
    fp8_values,
)
from hybridmoe.layers.rope_triton import check_paged_cache


@triton.jit
def _rotate(x1, x2, cos, sin, dtype):
    """The rotary pairs (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), each product and sum rounded to dtype."""
    a1 = (x1.to(tl.float32) * cos).to(dtype).to(tl.float32)
    b1 = (x2.to(tl.float32) * sin).to(dtype).to(tl.float32)
    a2 = (x2.to(tl.float32) * cos).to(dtype).to(tl.float32)
    b2 = (x1.to(tl.float32) * sin).to(dtype).to(tl.float32)
    return (a1 - b1).to(dtype), (a2 + b2).to(dtype)


@triton.jit
def _new_row(lat_ptr, kpe_ptr, nw_ptr, eps, cos, sin, R, r, rm, o1, o2, im, dtype):
    """One row's new cache entry from lat [R] and kpe [P] (before norm / rotary): the kv_a_layernorm'd latent
    [BLOCK_R] and the rotated k_pe pairs' first and second elements [BLOCK_P2] each, in dtype."""
    lat = tl.load(lat_ptr + r, mask=rm, other=0.0).to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(lat * lat, axis=0) / R + eps)
    nw = tl.load(nw_ptr + r, mask=rm, other=0.0).to(tl.float32)
    c_new = ((lat * inv).to(dtype).to(tl.float32) * nw).to(dtype)
    k1, k2 = _rotate(tl.load(kpe_ptr + o1, mask=im, other=0.0), tl.load(kpe_ptr + o2, mask=im, other=0.0), cos, sin,
                     dtype)
    return c_new, k1, k2


@triton.jit
def _store_new_row(cache_ptr, scale_ptr, table, pos, stride_cr, stride_sr, c_new, k1, k2, R, half, r, rm, i, im,
                   store, BS: tl.constexpr, QUANT: tl.constexpr):
    """A row's new cache entry (c_new [BLOCK_R], k1, k2 [BLOCK_P2] in the compute dtype) written at position pos
    of the sequence whose block-table row starts at table, where store (one of the programs that make it) -> the
    entry as a read of the cache gives it back. QUANT: float8 codes with the row's scale at scale_ptr
    (kv_quant.quantize_rows), given back dequantized."""
    c_st, k1_st, k2_st = c_new, k1, k2  # what the cache row holds
    if QUANT:
        amax = tl.maximum(tl.max(tl.where(rm, tl.abs(c_new.to(tl.float32)), 0.0), axis=0),
                          tl.maximum(tl.max(tl.where(im, tl.abs(k1.to(tl.float32)), 0.0), axis=0),
                                     tl.max(tl.where(im, tl.abs(k2.to(tl.float32)), 0.0), axis=0)))
        row_scale = fp8_scale(amax)
        c_st = fp8_codes(c_new, row_scale, cache_ptr.dtype.element_ty)
        k1_st = fp8_codes(k1, row_scale, cache_ptr.dtype.element_ty)
        k2_st = fp8_codes(k2, row_scale, cache_ptr.dtype.element_ty)
        c_new = fp8_values(c_st, row_scale, c_new.dtype)
        k1 = fp8_values(k1_st, row_scale, k1.dtype)
        k2 = fp8_values(k2_st, row_scale, k2.dtype)
    if store:
        new_at = tl.load(table + pos // BS).to(tl.int64) * BS + pos % BS
        new_row = cache_ptr + new_at * stride_cr
        tl.store(new_row + r, c_st, mask=rm)
        tl.store(new_row + R + i, k1_st, mask=im)
        tl.store(new_row + R + half + i, k2_st, mask=im)
        if QUANT:
            tl.store(scale_ptr + new_at * stride_sr, row_scale)
    return c_new, k1, k2


@triton.jit
def _mla_decode_kernel(q_ptr, qpe_ptr, lat_ptr, kpe_ptr, nw_ptr, positions_ptr, inv_freq_ptr, cache_ptr, scale_ptr,
                       bt_ptr, slot_ptr, len_ptr, out_ptr, m_ptr, l_ptr, eps, rope_scaling, scale, N, R, P, CHUNK,
                       stride_qb, stride_qh, stride_pb, stride_ph, stride_lb, stride_kb, stride_bt, stride_cr,
                       stride_sr, BS: tl.constexpr, INTERLEAVED: tl.constexpr, SPLIT: tl.constexpr,
                       QUANT: tl.constexpr, PRECISION: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_P2: tl.constexpr, BLOCK_L: tl.constexpr):
    """Program (hb, c, b): heads hb * BLOCK_H .. of row b over positions [c * CHUNK, (c + 1) * CHUNK) of its
    length. q [B, N, R] (q_nope with kv_b_proj's key half absorbed), qpe [B, N, P], lat [B, R], kpe [B, P]
    (before norm / rotary). SPLIT: the unnormalized sums and their (max, total) go to out, m, l
    [B, N, NC(, R)] for combine_chunks; else the normalized output to out [B, N, R]. QUANT: a float8 cache,
    its scales at scale_ptr (stride_sr: a row's)."""
    hb = tl.program_id(0)
    c = tl.program_id(1)
    b = tl.program_id(2)
    dtype = cache_ptr.dtype.element_ty
    if QUANT:  # float8 codes: the rest runs in the queries' dtype, as over an unquantized cache
        dtype = q_ptr.dtype.element_ty
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < N
    r = tl.arange(0, BLOCK_R)
    rm = r < R
    half = P // 2
    i = tl.arange(0, BLOCK_P2)
    im = i < half
    if INTERLEAVED:  # DeepSeek's checkpoints: pairs (x0, x1), (x2, x3), ...
        o1, o2 = 2 * i, 2 * i + 1
    else:  # the halves rotate together
        o1, o2 = i, i + half
    angle = tl.load(positions_ptr + b).to(tl.float32) * tl.load(inv_freq_ptr + i, mask=im, other=0.0)
    cos = (tl.cos(angle) * rope_scaling).to(dtype).to(tl.float32)
    sin = (tl.sin(angle) * rope_scaling).to(dtype).to(tl.float32)
    qm = hm[:, None] & rm[None, :]
    pm = hm[:, None] & im[None, :]
    qc = tl.load(q_ptr + b * stride_qb + h[:, None] * stride_qh + r[None, :], mask=qm, other=0.0)  # [BLOCK_H, BLOCK_R]
    qrow = qpe_ptr + b * stride_pb + h[:, None] * stride_ph
    q1, q2 = _rotate(tl.load(qrow + o1[None, :], mask=pm, other=0.0), tl.load(qrow + o2[None, :], mask=pm, other=0.0),
                     cos[None, :], sin[None, :], dtype)  # [BLOCK_H, BLOCK_P2] each
    n = tl.load(len_ptr + b)  # the row's positions 0 .. n - 1, the new token at n - 1
    table = bt_ptr + tl.load(slot_ptr + b).to(tl.int64) * stride_bt
    start = c * CHUNK
    m = tl.full((BLOCK_H,), -float("inf"), dtype=tl.float32)
    total = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_R), dtype=tl.float32)
    for l0 in range(start, tl.minimum(n - 1, start + CHUNK), BLOCK_L):  # the chunk's positions before the new one
        seen = l0 + tl.arange(0, BLOCK_L) < n - 1
        rows = tl.load(table + l0 // BS).to(tl.int64) * BS + l0 % BS + tl.arange(0, BLOCK_L)  # flat cache rows
        at = cache_ptr + rows[:, None] * stride_cr
        lat = tl.load(at + r[None, :], mask=seen[:, None] & rm[None, :], other=0.0)  # [BLOCK_L, BLOCK_R]
        p1 = tl.load(at + R + i[None, :], mask=seen[:, None] & im[None, :], other=0.0)
        p2 = tl.load(at + R + half + i[None, :], mask=seen[:, None] & im[None, :], other=0.0)
        if QUANT:
            row_scale = tl.load(scale_ptr + rows * stride_sr, mask=seen, other=0.0)[:, None]
            lat = fp8_values(lat, row_scale, dtype)
            p1 = fp8_values(p1, row_scale, dtype)
            p2 = fp8_values(p2, row_scale, dtype)
        s = (tl.dot(qc, tl.trans(lat), input_precision=PRECISION)
             + tl.dot(q1, tl.trans(p1), input_precision=PRECISION)
             + tl.dot(q2, tl.trans(p2), input_precision=PRECISION)) * scale  # [BLOCK_H, BLOCK_L]
        s = tl.where(seen[None, :], s, -float("inf"))
        m_next = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_next)
        p = tl.exp(s - m_next[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(dtype), lat, input_precision=PRECISION)
        m = m_next
    if (start <= n - 1) & (n - 1 < start + CHUNK):  # the chunk of the new token: its row from registers
        c_new, k1, k2 = _new_row(lat_ptr + b * stride_lb, kpe_ptr + b * stride_kb, nw_ptr, eps, cos, sin, R, r, rm,
                                 o1, o2, im, dtype)
        c_new, k1, k2 = _store_new_row(cache_ptr, scale_ptr, table, n - 1, stride_cr, stride_sr, c_new, k1, k2, R,
                                       half, r, rm, i, im, hb == 0, BS, QUANT)
        s_new = (tl.sum(qc.to(tl.float32) * c_new.to(tl.float32)[None, :], axis=1)
                 + tl.sum(q1.to(tl.float32) * k1.to(tl.float32)[None, :], axis=1)
                 + tl.sum(q2.to(tl.float32) * k2.to(tl.float32)[None, :], axis=1)) * scale  # [BLOCK_H]
        m_last = tl.maximum(m, s_new)
        alpha = tl.exp(m - m_last)
        p_new = tl.exp(s_new - m_last)
        total = total * alpha + p_new
        acc = acc * alpha[:, None] + p_new.to(dtype).to(tl.float32)[:, None] * c_new.to(tl.float32)[None, :]
        m = m_last
    if SPLIT:
        part = (b * N + h) * tl.num_programs(1) + c  # [BLOCK_H] index into [B, N, NC]
        tl.store(m_ptr + part, m, mask=hm)
        tl.store(l_ptr + part, total, mask=hm)
        tl.store(out_ptr + part[:, None].to(tl.int64) * R + r[None, :], acc, mask=qm)
    else:
        tl.store(out_ptr + (b * N + h[:, None]) * R + r[None, :], (acc / total[:, None]).to(out_ptr.dtype.element_ty),
                 mask=qm)


MIN_CHUNK = 256
"""The fewest positions a chunk program reads: fewer would make the partial sums ([B, N, NC, R] float32, written
and read again by the combine) a sizeable share of the traffic next to the cache they summarize."""

TARGET_PROGRAMS = 512
"""Programs a long decode launches at least (about 4 per SM of a 132-SM H100), by cutting rows into chunks."""


def chunk_len(max_len: int, programs_per_chunk: int) -> int:
    """Positions per chunk program for caches of up to max_len positions when each chunk takes
    programs_per_chunk programs (rows x head blocks): a power of two, at least MIN_CHUNK, small enough
    that the launch has about TARGET_PROGRAMS programs."""
    chunks = max(1, TARGET_PROGRAMS // programs_per_chunk)
    return max(MIN_CHUNK, triton.next_power_of_2(triton.cdiv(max_len, chunks)))


def triton_mla_decode(q_abs: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                      norm_weight: torch.Tensor, eps: float, positions: torch.Tensor, inv_freq: torch.Tensor,
                      rope_scaling: float, interleaved: bool, cache: torch.Tensor, block_table: torch.Tensor,
                      slots: torch.Tensor, lens: torch.Tensor, scale: float, max_len: int,
                      kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """MultiHeadLatentAttention's decode step from the absorbed queries to the attention over the latents.

    q_abs [B, N, R]; q_pe [B, N, P] and k_pe [B, P] before rotary (at positions [B]); latent [B, R] before
    kv_a_layernorm (norm_weight [R], eps); cache [NB, BS, R + P]; row b's sequence in slot slots[b] (its
    blocks: block_table [S, M] int32, row slots[b]), its length with the new token lens[b] (written at
    position lens[b] - 1); max_len: a bound on lens known on the host (the padded length of a fixed-shape
    step), which sets the chunks; lens and the block table are read on the device only -> [B, N, R] in
    q_abs's dtype. Last dims contiguous. kv_scale [NB, BS, 1]: a float8 cache's scales (kv_quant.py), the new row
    written quantized with its own.
    """
    B, N, R = q_abs.shape
    P = q_pe.shape[-1]
    BS = check_paged_cache(cache, block_table=block_table)
    quant = check_fp8_scales((cache,), (kv_scale,))
    dtype = q_abs.dtype if quant else cache.dtype
    out = torch.empty(B, N, R, dtype=q_abs.dtype, device=q_abs.device)
    block_h = 16
    heads = triton.cdiv(N, block_h)
    chunk = chunk_len(max_len, B * heads)
    NC = triton.cdiv(max_len, chunk)
    if NC == 1:
        parts = (out, out, out)
    else:
        parts = (torch.empty(B, N, NC, R, dtype=torch.float32, device=q_abs.device),
                 torch.empty(B, N, NC, dtype=torch.float32, device=q_abs.device),
                 torch.empty(B, N, NC, dtype=torch.float32, device=q_abs.device))
    _mla_decode_kernel[(heads, NC, B)](
        q_abs, q_pe, latent, k_pe, norm_weight, positions, inv_freq, cache, kv_scale if quant else cache,
        block_table, slots, lens, *parts, eps, rope_scaling, scale, N, R, P, chunk, q_abs.stride(0), q_abs.stride(1),
        q_pe.stride(0), q_pe.stride(1), latent.stride(0), k_pe.stride(0), block_table.stride(0), cache.stride(1),
        kv_scale.stride(1) if quant else 0, BS=BS, INTERLEAVED=interleaved, SPLIT=NC > 1, QUANT=quant,
        PRECISION="ieee" if dtype == torch.float32 else "tf32", BLOCK_H=block_h,
        BLOCK_R=triton.next_power_of_2(R), BLOCK_P2=max(16, triton.next_power_of_2(P // 2)), BLOCK_L=min(32, BS),
        num_warps=8)
    if NC > 1:
        acc, m, total = parts
        combine_chunks(acc.view(B * N, NC, R), m.view(B * N, NC), total.view(B * N, NC), out.view(B * N, R))
    return out
