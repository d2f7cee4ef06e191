"""A decode step of multi-head latent attention (layers/mla.py) over its latent cache, as one Triton kernel.

torch runs it as ~25 kernels per layer: cos/sin, the two rotaries (slices, products, cat), the latent's
RMSNorm, the cat of the cache row and its write, the gather of every row's cache up to the padded length,
two matmuls, the mask, the softmax and its casts. Here one program per (row, block of BLOCK_H heads):
the new token's cache row (the normalized latent c and the rotated k_pe) and the heads' rotated q_pe are
made in registers (every rounding of the torch ops kept), block 0 writes the row into the cache; then the
heads attend over the row's cached positions before the new one with an online softmax in float32, the
new key last, from registers (so no program reads what another writes). Probabilities are rounded to the
cache dtype before they weigh the latents, as flash attention does; scores stay float32 (torch rounds
them to the model dtype first).

B rows (one new token each), N heads, R kv_lora_rank, P qk_rope_head_dim (pairs rotated: P / 2), S slots,
L cached positions. Cache rows: [c (R) | rotated k_pe, first elements of each pair (P / 2) | second (P / 2)].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(x1, x2, cos, sin, dtype):
    """The rotary pairs (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), each product and sum rounded to dtype."""
    a1 = (x1.to(tl.float32) * cos).to(dtype).to(tl.float32)
    b1 = (x2.to(tl.float32) * sin).to(dtype).to(tl.float32)
    a2 = (x2.to(tl.float32) * cos).to(dtype).to(tl.float32)
    b2 = (x1.to(tl.float32) * sin).to(dtype).to(tl.float32)
    return (a1 - b1).to(dtype), (a2 + b2).to(dtype)


@triton.jit
def _mla_decode_kernel(q_ptr, qpe_ptr, lat_ptr, kpe_ptr, nw_ptr, positions_ptr, inv_freq_ptr, cache_ptr, slot_ptr,
                       len_ptr, out_ptr, eps, rope_scaling, scale, N, R, P,
                       stride_qb, stride_qh, stride_pb, stride_ph, stride_lb, stride_kb, stride_cs, stride_cl,
                       INTERLEAVED: tl.constexpr, PRECISION: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_P2: tl.constexpr, BLOCK_L: tl.constexpr):
    """Program (b, hb): heads hb * BLOCK_H .. of row b. q [B, N, R] (q_nope with kv_b_proj's key half absorbed),
    qpe [B, N, P], lat [B, R], kpe [B, P] (before norm / rotary) -> out [B, N, R]."""
    b = tl.program_id(0)
    hb = tl.program_id(1)
    dtype = cache_ptr.dtype.element_ty
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
    lat = tl.load(lat_ptr + b * stride_lb + r, mask=rm, other=0.0).to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(lat * lat, axis=0) / R + eps)
    nw = tl.load(nw_ptr + r, mask=rm, other=0.0).to(tl.float32)
    c_new = ((lat * inv).to(dtype).to(tl.float32) * nw).to(dtype)  # [BLOCK_R] the kv_a_layernorm'd latent
    k1, k2 = _rotate(tl.load(kpe_ptr + b * stride_kb + o1, mask=im, other=0.0),
                     tl.load(kpe_ptr + b * stride_kb + o2, mask=im, other=0.0), cos, sin, dtype)  # [BLOCK_P2] each
    n = tl.load(len_ptr + b)  # the row's positions 0 .. n - 1, the new token at n - 1
    slot_base = tl.load(slot_ptr + b).to(tl.int64) * stride_cs
    if hb == 0:
        new_row = cache_ptr + slot_base + (n - 1).to(tl.int64) * stride_cl
        tl.store(new_row + r, c_new, mask=rm)
        tl.store(new_row + R + i, k1, mask=im)
        tl.store(new_row + R + half + i, k2, mask=im)
    m = tl.full((BLOCK_H,), -float("inf"), dtype=tl.float32)
    total = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_R), dtype=tl.float32)
    for l0 in range(0, n - 1, BLOCK_L):  # the cached positions before the new one
        pos = l0 + tl.arange(0, BLOCK_L)
        seen = pos < n - 1
        at = cache_ptr + slot_base + pos[:, None].to(tl.int64) * stride_cl
        c = tl.load(at + r[None, :], mask=seen[:, None] & rm[None, :], other=0.0)  # [BLOCK_L, BLOCK_R]
        p1 = tl.load(at + R + i[None, :], mask=seen[:, None] & im[None, :], other=0.0)
        p2 = tl.load(at + R + half + i[None, :], mask=seen[:, None] & im[None, :], other=0.0)
        s = (tl.dot(qc, tl.trans(c), input_precision=PRECISION) + tl.dot(q1, tl.trans(p1), input_precision=PRECISION)
             + tl.dot(q2, tl.trans(p2), input_precision=PRECISION)) * scale  # [BLOCK_H, BLOCK_L]
        s = tl.where(seen[None, :], s, -float("inf"))
        m_next = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_next)
        p = tl.exp(s - m_next[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(dtype), c, input_precision=PRECISION)
        m = m_next
    s_new = (tl.sum(qc.to(tl.float32) * c_new.to(tl.float32)[None, :], axis=1)
             + tl.sum(q1.to(tl.float32) * k1.to(tl.float32)[None, :], axis=1)
             + tl.sum(q2.to(tl.float32) * k2.to(tl.float32)[None, :], axis=1)) * scale  # [BLOCK_H]
    m_last = tl.maximum(m, s_new)
    alpha = tl.exp(m - m_last)
    p_new = tl.exp(s_new - m_last)
    total = total * alpha + p_new
    acc = acc * alpha[:, None] + p_new.to(dtype).to(tl.float32)[:, None] * c_new.to(tl.float32)[None, :]
    tl.store(out_ptr + (b * N + h[:, None]) * R + r[None, :], (acc / total[:, None]).to(out_ptr.dtype.element_ty),
             mask=qm)


def triton_mla_decode(q_abs: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                      norm_weight: torch.Tensor, eps: float, positions: torch.Tensor, inv_freq: torch.Tensor,
                      rope_scaling: float, interleaved: bool, cache: torch.Tensor, slots: torch.Tensor,
                      lens: torch.Tensor, scale: float) -> torch.Tensor:
    """MultiHeadLatentAttention's decode step from the absorbed queries to the attention over the latents.

    q_abs [B, N, R]; q_pe [B, N, P] and k_pe [B, P] before rotary (at positions [B]); latent [B, R] before
    kv_a_layernorm (norm_weight [R], eps); cache [S, L, R + P], row b's slot slots[b], its length with the
    new token lens[b] (written at lens[b] - 1) -> [B, N, R] in q_abs's dtype. Last dims contiguous.
    """
    B, N, R = q_abs.shape
    P = q_pe.shape[-1]
    out = torch.empty(B, N, R, dtype=q_abs.dtype, device=q_abs.device)
    block_h = 16
    _mla_decode_kernel[(B, triton.cdiv(N, block_h))](
        q_abs, q_pe, latent, k_pe, norm_weight, positions, inv_freq, cache, slots, lens, out, eps, rope_scaling,
        scale, N, R, P, q_abs.stride(0), q_abs.stride(1), q_pe.stride(0), q_pe.stride(1), latent.stride(0),
        k_pe.stride(0), cache.stride(0), cache.stride(1), INTERLEAVED=interleaved,
        PRECISION="ieee" if cache.dtype == torch.float32 else "tf32", BLOCK_H=block_h,
        BLOCK_R=triton.next_power_of_2(R), BLOCK_P2=max(16, triton.next_power_of_2(P // 2)), BLOCK_L=32,
        num_warps=8)
    return out
