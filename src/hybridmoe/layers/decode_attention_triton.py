"""Decode attention (one new token per sequence) over the paged KV cache, as one Triton kernel.

torch gathers every row's cache up to the padded length, builds the mask and runs SDPA: ~8 kernels
per layer, each with its launch and drain in a decode step's CUDA graph. Here one program per
(sequence, key/value head, chunk of CHUNK positions) takes that head's G = Hq / Hkv query heads
together and walks the chunk from its oldest visible key to the row's length (read at run time,
so a replayed graph reads no more than the row holds), with an online softmax in float32;
probabilities are rounded to the cache dtype (a float8 cache: the queries') before they weigh the
values, as flash attention does. Up to CHUNK positions that is the one kernel; a longer cache adds a
second that combines the chunks (flash-decoding).

Sinks (gpt-oss, layers/sink_attention.py: a learned logit per query head that joins the softmax and weighs no
value) enter once, where the softmax is normalized: the one-chunk kernels fold the head's sink into the running
(max, total) after the last key, and with several chunks the combine does, so the chunks' partial sums never see it.

The cache is paged: position p of the sequence in slot s lives in block block_table[s, p // BS] at row
p % BS. Keys are read in tiles of BLOCK_L positions, BLOCK_L a divisor of BS, so a tile lies inside one
block: one block-table read per tile, and each key row is a contiguous load as in an unpaged cache.

A float8 cache (layers/kv_quant.py: e4m3 codes, a float32 scale per token and head beside them in
k_scale / v_scale [NB, BS, Hkv, 1]) is read in place: each tile's codes are widened to float32, times their
rows' scales, and rounded to the queries' dtype, the values an unquantized cache would hold after
kv_quant.read_positions; from there the kernels run as for an unquantized cache. Without scales (QUANT off)
that code is not compiled.

B sequences, Hq query heads, Hkv key/value heads, Dk / Dv key / value head dims, NB blocks of BS
positions, S slots, M blocks per slot's table, NC chunks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridmoe.layers.kv_quant import FP8, FP8_MAX
from hybridmoe.layers.rope_triton import check_paged_cache, norm_rope_heads

_FP8_MAX = tl.constexpr(FP8_MAX)


@triton.jit
def fp8_scale(amax):
    """A float8 row's scale from its largest magnitude, as kv_quant.quantize_rows computes it (the division
    correctly rounded, as torch's is, so a row the kernels write holds the codes torch would write)."""
    return tl.math.div_rn(tl.maximum(amax, 1e-30), _FP8_MAX)


@triton.jit
def fp8_codes(x, row_scale, code_dtype: tl.constexpr):
    """x / row_scale (correctly rounded, in float32) rounded to float8 code_dtype, as kv_quant.quantize_rows."""
    return tl.math.div_rn(x.to(tl.float32), row_scale).to(code_dtype)


@triton.jit
def fp8_values(codes, row_scale, dtype: tl.constexpr):
    """Float8 codes times their scale, rounded to dtype: kv_quant.read_positions' values."""
    return (codes.to(tl.float32) * row_scale).to(dtype)


@triton.jit
def _attend(q, k_ptr, v_ptr, ks_ptr, vs_ptr, table, k_head, v_head, s_head, first, end, scale, stride_kr, stride_vr,
            stride_sr, DK, DV, BS: tl.constexpr, QUANT: tl.constexpr, PRECISION: tl.constexpr,
            BLOCK_G: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr):
    """q [BLOCK_G, BLOCK_DK] over the cached keys/values at positions [first, end) of the sequence whose
    block-table row starts at table (k_head, v_head: the head's offset in a cache row) -> the online
    softmax's (max [BLOCK_G], total [BLOCK_G], unnormalized sum [BLOCK_G, BLOCK_DV]), float32; no key:
    (-inf, 0, 0). QUANT: the cache holds float8 codes, their scales at ks_ptr / vs_ptr (s_head: the head's
    offset in a scale row, stride_sr: a row's), dequantized to q's dtype tile by tile."""
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    m = tl.full((BLOCK_G,), -float("inf"), dtype=tl.float32)
    total = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_DV), dtype=tl.float32)
    # tiles from the one holding the first visible key: each holds at least one, so m stays finite
    for l0 in range(first // BLOCK_L * BLOCK_L, tl.where(first < end, end, 0), BLOCK_L):
        pos = l0 + tl.arange(0, BLOCK_L)
        rows = tl.load(table + l0 // BS).to(tl.int64) * BS + l0 % BS + tl.arange(0, BLOCK_L)  # flat cache rows
        seen = pos < end
        k = tl.load(k_ptr + k_head + rows[:, None] * stride_kr + dk[None, :], mask=seen[:, None] & (dk < DK)[None, :],
                    other=0.0)
        if QUANT:
            k = fp8_values(k, tl.load(ks_ptr + s_head + rows * stride_sr, mask=seen, other=0.0)[:, None], q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_G, BLOCK_L]
        s = tl.where(((pos >= first) & seen)[None, :], s, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + v_head + rows[:, None] * stride_vr + dv[None, :], mask=seen[:, None] & (dv < DV)[None, :],
                    other=0.0)
        if QUANT:
            v = fp8_values(v, tl.load(vs_ptr + s_head + rows * stride_sr, mask=seen, other=0.0)[:, None], q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    return m, total, acc


@triton.jit
def with_sink(m, total, acc, sink):
    """The online softmax's (max, total, unnormalized sum) over some keys, rows [BLOCK_G], with each row's sink
    logit (float32 [BLOCK_G]) joining the total: it weighs no value, so acc is only rescaled to the new max."""
    m_new = tl.maximum(m, sink)
    alpha = tl.exp(m - m_new)
    return m_new, total * alpha + tl.exp(sink - m_new), acc * alpha[:, None]


@triton.jit
def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, bt_ptr, slot_ptr, len_ptr, sink_ptr, out_ptr, m_ptr,
                             l_ptr, scale, window, G, DK, DV, stride_qb, stride_qh, stride_bt, stride_kr, stride_kh,
                             stride_vr, stride_vh, stride_sr, stride_sh, CHUNK, BS: tl.constexpr,
                             HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr, QUANT: tl.constexpr,
                             HAS_SINKS: tl.constexpr, PRECISION: tl.constexpr, BLOCK_G: tl.constexpr,
                             BLOCK_L: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Program (b, kh, c): row b's query heads of key/value head kh over the visible keys of positions
    [c * CHUNK, (c + 1) * CHUNK). SPLIT: the unnormalized sum and its (max, total) go to out, m, l
    [B, Hq, NC(, Dv)] for combine_chunks (which adds the sinks); else the normalized output to out [B, Hq, Dv],
    with HAS_SINKS each head's sink (sink_ptr [Hq]) in its softmax. QUANT: a float8 cache, its scales at ks_ptr,
    vs_ptr (stride_sr, stride_sh: a scale row's and head's strides)."""
    b = tl.program_id(0)
    kh = tl.program_id(1)
    c = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    heads = kh * G + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dk[None, :],
                mask=(g < G)[:, None] & (dk < DK)[None, :], other=0.0)
    n = tl.load(len_ptr + b)  # the row's keys: positions 0 .. n - 1, its new token at n - 1
    first = c * CHUNK
    if HAS_WINDOW:
        first = tl.maximum(first, n - window)  # keys > (n - 1) - window
    end = tl.minimum(n, (c + 1) * CHUNK)
    table = bt_ptr + tl.load(slot_ptr + b).to(tl.int64) * stride_bt
    m, total, acc = _attend(q, k_ptr, v_ptr, ks_ptr, vs_ptr, table, kh * stride_kh, kh * stride_vh, kh * stride_sh,
                            first, end, scale, stride_kr, stride_vr, stride_sr, DK, DV, BS, QUANT, PRECISION,
                            BLOCK_G, BLOCK_L, BLOCK_DK, BLOCK_DV)
    out_mask = (g < G)[:, None] & (dv < DV)[None, :]
    if SPLIT:
        NC = tl.num_programs(2)
        part = (b * G * tl.num_programs(1) + heads) * NC + c  # [BLOCK_G] index into [B, Hq, NC]
        tl.store(m_ptr + part, m, mask=g < G)
        tl.store(l_ptr + part, total, mask=g < G)
        tl.store(out_ptr + part[:, None] * DV + dv[None, :], acc, mask=out_mask)
    else:
        if HAS_SINKS:
            m, total, acc = with_sink(m, total, acc, tl.load(sink_ptr + heads, mask=g < G, other=0.0).to(tl.float32))
        tl.store(out_ptr + (b * G * tl.num_programs(1) + heads[:, None]) * DV + dv[None, :],
                 (acc / total[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _store_head(c_ptr, s_ptr, at, s_at, cols, inside, x, QUANT: tl.constexpr):
    """One head's new row x [1, BLOCK_D] (cols: its columns, inside: those < D) into the cache at c_ptr + at
    -> the row as a read of the cache gives it back. QUANT: stored as float8 codes with its scale at
    s_ptr + s_at (kv_quant.quantize_rows) and given back dequantized in x's dtype; else in the cache's dtype."""
    if QUANT:
        row_scale = fp8_scale(tl.max(tl.where(inside, tl.abs(x.to(tl.float32)), 0.0)))
        codes = fp8_codes(x, row_scale, c_ptr.dtype.element_ty)
        tl.store(c_ptr + at + cols, codes, mask=inside)
        tl.store(s_ptr + s_at, row_scale)
        x = fp8_values(codes, row_scale, x.dtype)
    else:
        x = x.to(c_ptr.dtype.element_ty)
        tl.store(c_ptr + at + cols, x, mask=inside)
    return x


@triton.jit
def _rope_attention_kernel(qkv_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, q_w_ptr, k_w_ptr, positions_ptr, inv_freq_ptr,
                           token_row_ptr, bt_ptr, slot_ptr, len_ptr, sink_ptr, out_ptr, rope_scaling, eps, scale,
                           window, G, D, Hq, Hkv, stride_t, stride_bt, stride_cr, stride_ch, stride_sr, stride_sh,
                           BS: tl.constexpr, HAS_NORM: tl.constexpr, HAS_WINDOW: tl.constexpr, QUANT: tl.constexpr,
                           HAS_SINKS: tl.constexpr, PRECISION: tl.constexpr, BLOCK_G: tl.constexpr,
                           BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program (b, kh): row b's new token from the merged projection qkv [B, (Hq + 2 Hkv) D]: its G query
    heads of key/value head kh and that key head normalized and rotated (rope_triton.norm_rope_heads), the
    key and value written to the cache's flat row token_row[b]; then the queries over the cached keys
    before it (visible ones, through the block table) and, last, over the new key, held in registers (no
    program reads a row another writes) -> out [B, Hq, D]; HAS_SINKS: each head's sink (sink_ptr [Hq]) joins its
    softmax. QUANT: a float8 cache, its scales at ks_ptr, vs_ptr (stride_sr, stride_sh: a scale row's and head's
    strides); the new key and value are written quantized and weigh in as their dequantized values, as every cached
    one does."""
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
    k = norm_rope_heads(x, xp, w, wp, angle, right, rope_scaling, eps, D, HAS_NORM)
    v = tl.load(row + (Hq + Hkv + kh) * D + cols, mask=inside, other=0.0)  # [1, BLOCK_D]
    token_row = tl.load(token_row_ptr + b).to(tl.int64)
    at = token_row * stride_cr + kh * stride_ch
    s_at = token_row * stride_sr + kh * stride_sh
    k = _store_head(k_ptr, ks_ptr, at, s_at, cols, inside, k, QUANT)
    v = _store_head(v_ptr, vs_ptr, at, s_at, cols, inside, v, QUANT)
    n = tl.load(len_ptr + b)  # the row's keys: positions 0 .. n - 1, its new token at n - 1
    first = n * 0
    if HAS_WINDOW:
        first = tl.maximum(first, n - window)  # keys > (n - 1) - window
    table = bt_ptr + tl.load(slot_ptr + b).to(tl.int64) * stride_bt
    m, total, acc = _attend(q, k_ptr, v_ptr, ks_ptr, vs_ptr, table, kh * stride_ch, kh * stride_ch, kh * stride_sh,
                            first, n - 1, scale, stride_cr, stride_cr, stride_sr, D, D, BS, QUANT, PRECISION, BLOCK_G,
                            BLOCK_L, BLOCK_D, BLOCK_D)
    s = tl.sum(q.to(tl.float32) * k.to(tl.float32), axis=1) * scale  # [BLOCK_G] the new key's scores
    m_new = tl.maximum(m, s)
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new)
    total = total * alpha + p
    acc = acc * alpha[:, None] + p.to(v.dtype).to(tl.float32)[:, None] * v.to(tl.float32)
    if HAS_SINKS:
        m, total, acc = with_sink(m_new, total, acc, tl.load(sink_ptr + heads, mask=g < G, other=0.0).to(tl.float32))
    tl.store(out_ptr + (b * Hq + heads[:, None]) * D + cols, (acc / total[:, None]).to(out_ptr.dtype.element_ty),
             mask=q_mask)


@triton.jit
def _combine_kernel(acc_ptr, m_ptr, l_ptr, sink_ptr, out_ptr, NC, D, heads, BLOCK_C: tl.constexpr,
                    BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Program (row, db): columns db * BLOCK_D .. of one output row from its NC chunks' partial softmax sums,
    BLOCK_C chunks at a time: first the largest chunk max, then the sums rescaled to it. HAS_SINKS: row r's
    sink logit sink_ptr[r % heads] joins the max and the total (once, here)."""
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    top = tl.full((BLOCK_C,), -float("inf"), dtype=tl.float32)
    for c0 in range(0, NC, BLOCK_C):
        top = tl.maximum(top, tl.load(m_ptr + row * NC + c0 + c, mask=c0 + c < NC, other=-float("inf")))
    top_all = tl.max(top, axis=0)  # finite: the chunk holding the new token has a key
    if HAS_SINKS:
        sink = tl.load(sink_ptr + row % heads).to(tl.float32)
        top_all = tl.maximum(top_all, sink)
    total = tl.zeros((BLOCK_C,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_C, BLOCK_D), dtype=tl.float32)
    for c0 in range(0, NC, BLOCK_C):
        cs = c0 + c
        scale = tl.exp(tl.load(m_ptr + row * NC + cs, mask=cs < NC, other=-float("inf")) - top_all)  # no key: 0
        total += tl.load(l_ptr + row * NC + cs, mask=cs < NC, other=0.0) * scale
        acc += tl.load(acc_ptr + (row * NC + cs)[:, None].to(tl.int64) * D + d[None, :],
                       mask=(cs < NC)[:, None] & (d < D)[None, :], other=0.0) * scale[:, None]
    denominator = tl.sum(total, axis=0)
    if HAS_SINKS:
        denominator += tl.exp(sink - top_all)
    out = tl.sum(acc, axis=0) / denominator
    tl.store(out_ptr + row * D + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


def combine_chunks(acc: torch.Tensor, m: torch.Tensor, total: torch.Tensor, out: torch.Tensor,
                   sinks: torch.Tensor | None = None) -> None:
    """Flash-decoding's second step: the chunks' partial softmax sums acc [rows, NC, D] (float32, unnormalized)
    with their maxima m and totals total [rows, NC] -> out [rows, D] (written; any row-major view). sinks [heads]:
    row r's softmax also holds the logit sinks[r % heads] (rows are (sequence, head) pairs), which weighs no value."""
    rows, NC, D = acc.shape
    block_d = min(128, triton.next_power_of_2(D))
    heads = sinks.numel() if sinks is not None else 1
    _combine_kernel[(rows, triton.cdiv(D, block_d))](acc, m, total, sinks if sinks is not None else m, out, NC, D,
                                                     heads, BLOCK_C=min(16, triton.next_power_of_2(NC)),
                                                     BLOCK_D=block_d, HAS_SINKS=sinks is not None)


CHUNK = 512
"""Positions per program: a row's cache longer than this is split into chunks run side by side (each
(row, key/value head) is one program otherwise, too few to read a long cache fast), then combined."""


def check_fp8_scales(caches: tuple[torch.Tensor, ...], scales: tuple[torch.Tensor | None, ...]) -> bool:
    """Whether the paged caches are float8 with their scales (each cache's shape with a last dim of 1, float32,
    contiguous) rather than in a compute dtype with none (all None). ValueError for any other mix."""
    if all(s is None for s in scales):
        if any(c.dtype == FP8 for c in caches):
            raise ValueError("a float8 KV cache needs its scales")
        return False
    for cache, s in zip(caches, scales):
        if s is None or cache.dtype != FP8 or s.dtype != torch.float32 or s.shape != (*cache.shape[:-1], 1):
            raise ValueError(f"a float8 KV cache {tuple(cache.shape)} comes with float32 scales "
                             f"{(*cache.shape[:-1], 1)}, got {cache.dtype} and "
                             f"{None if s is None else (s.dtype, tuple(s.shape))}")
    check_paged_cache(*scales)
    return True


def _gqa_scale_args(k_cache, v_cache, k_scale, v_scale) -> tuple:
    """The kernels' (ks_ptr, vs_ptr, stride_sr, stride_sh, QUANT) for caches [NB, BS, Hkv, D]: a float8 cache's
    scales [NB, BS, Hkv, 1]; else the caches in their place, never read (QUANT off)."""
    if check_fp8_scales((k_cache, v_cache), (k_scale, v_scale)):
        return k_scale, v_scale, k_scale.stride(1), k_scale.stride(2), True
    return k_cache, v_cache, 0, 0, False


def triton_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                            slots: torch.Tensor, lens: torch.Tensor, scale: float, sliding_window: int | None,
                            max_len: int, k_scale: torch.Tensor | None = None,
                            v_scale: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, Dk] (row b's new token) over k_cache [NB, BS, Hkv, Dk], v_cache [NB, BS, Hkv, Dv], the
    sequence in slot slots[b] (its blocks: block_table [S, M] int32, row slots[b]), positions
    0 .. lens[b] - 1 (within the window, if any) -> [B, Hq, Dv]. max_len: a bound on lens (known on
    the host: the padded length of a fixed-shape step), which sets the chunks; lens and the block table
    are read on the device only. k_scale, v_scale [NB, BS, Hkv, 1]: a float8 cache's scales (kv_quant.py).
    sinks [Hq]: each head's sink logit (gpt-oss), or None."""
    B, Hq, DK = q.shape
    Hkv, DV = v_cache.shape[2:]
    BS = check_paged_cache(k_cache, v_cache, block_table=block_table)
    ks, vs, stride_sr, stride_sh, quant = _gqa_scale_args(k_cache, v_cache, k_scale, v_scale)
    q = q.contiguous()
    out = torch.empty(B, Hq, DV, dtype=q.dtype, device=q.device)
    G = Hq // Hkv
    NC = triton.cdiv(max_len, CHUNK)
    blocks = {"BLOCK_G": max(16, triton.next_power_of_2(G)), "BLOCK_L": min(64, BS),
              "BLOCK_DK": max(16, triton.next_power_of_2(DK)), "BLOCK_DV": max(16, triton.next_power_of_2(DV))}
    args = (scale, sliding_window or 0, G, DK, DV, q.stride(0), q.stride(1), block_table.stride(0),
            k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2), stride_sr, stride_sh, CHUNK)
    flags = {"BS": BS, "HAS_WINDOW": sliding_window is not None, "QUANT": quant,
             "PRECISION": "ieee" if q.dtype == torch.float32 else "tf32"}
    _check_sinks(sinks, Hq)
    flags["HAS_SINKS"] = sinks is not None
    caches = (q, k_cache, v_cache, ks, vs, block_table, slots, lens, sinks if sinks is not None else q)
    if NC == 1:
        _decode_attention_kernel[(B, Hkv, 1)](*caches, out, out, out, *args, SPLIT=False, **flags, **blocks)
        return out
    acc = torch.empty(B, Hq, NC, DV, dtype=torch.float32, device=q.device)
    m = torch.empty(B, Hq, NC, dtype=torch.float32, device=q.device)
    total = torch.empty_like(m)
    _decode_attention_kernel[(B, Hkv, NC)](*caches, acc, m, total, *args, SPLIT=True, **flags, **blocks)
    combine_chunks(acc.view(B * Hq, NC, DV), m.view(B * Hq, NC), total.view(B * Hq, NC), out.view(B * Hq, DV), sinks)
    return out


def _check_sinks(sinks: torch.Tensor | None, heads: int) -> None:
    """sinks, if any, one float logit per query head, contiguous (the kernels read sinks[h])."""
    if sinks is not None and (tuple(sinks.shape) != (heads,) or not sinks.dtype.is_floating_point
                              or not sinks.is_contiguous()):
        raise ValueError(f"sinks must be a contiguous float tensor [{heads}] (one logit per query head), got "
                         f"{sinks.dtype} {tuple(sinks.shape)}")


def triton_rope_decode_attention(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                                 q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                                 positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float,
                                 k_cache: torch.Tensor, v_cache: torch.Tensor, token_row: torch.Tensor,
                                 block_table: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor, scale: float,
                                 sliding_window: int | None, k_scale: torch.Tensor | None = None,
                                 v_scale: torch.Tensor | None = None, sinks: torch.Tensor | None = None
                                 ) -> torch.Tensor:
    """A decode step's rope_triton.triton_norm_rope_cache then triton_decode_attention in one kernel, for
    caches of at most CHUNK positions (max_len <= CHUNK: one program per (row, key/value head) reads it all).

    qkv [B, (Hq + 2 Hkv) D], one new token per row b at positions[b], its key and value written at the flat
    row token_row[b] (block * BS + offset) of k_cache, v_cache [NB, BS, Hkv, D]; block_table [S, M] int32,
    slots, lens: the rows' slots and lengths with the new token (it sits at position lens[b] - 1, which
    token_row[b] addresses) -> [B, Hq, D]. k_scale, v_scale [NB, BS, Hkv, 1]: a float8 cache's scales
    (kv_quant.py), the new key and value written quantized with theirs. sinks [Hq]: each head's sink logit
    (gpt-oss), or None.
    """
    B = qkv.shape[0]
    BS = check_paged_cache(k_cache, v_cache, block_table=block_table)
    ks, vs, stride_sr, stride_sh, quant = _gqa_scale_args(k_cache, v_cache, k_scale, v_scale)
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    out = torch.empty(B, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    G = num_heads // num_kv_heads
    has_norm = q_weight is not None
    _check_sinks(sinks, num_heads)
    _rope_attention_kernel[(B, num_kv_heads)](
        qkv, k_cache, v_cache, ks, vs, q_weight if has_norm else qkv, k_weight if has_norm else qkv, positions,
        inv_freq, token_row, block_table, slots, lens, sinks if sinks is not None else qkv, out, attention_scaling,
        eps, scale, sliding_window or 0, G, head_dim, num_heads, num_kv_heads, qkv.stride(0), block_table.stride(0),
        k_cache.stride(1), k_cache.stride(2), stride_sr, stride_sh, BS=BS, HAS_NORM=has_norm,
        HAS_WINDOW=sliding_window is not None, QUANT=quant, HAS_SINKS=sinks is not None,
        PRECISION="ieee" if qkv.dtype == torch.float32 else "tf32", BLOCK_G=max(16, triton.next_power_of_2(G)),
        BLOCK_L=min(64, BS), BLOCK_D=max(16, triton.next_power_of_2(head_dim)))
    return out
