"""From the merged q/k/v projection to rotated queries and a written KV cache, in one Triton kernel.

For GQA attention (layers/attention.py) torch runs this as ~23 kernels per layer: cos/sin from the
positions (~9), q_norm and k_norm, rotate_half and the products for q and k (~10), the two cache
writes. In a decode step each costs its launch and drain even inside a CUDA graph. One program
per (token, head): a query head is normalized (Qwen3's q_norm), rotated and stored; a key head is
normalized, rotated and written into the paged cache at its token's flat row (block * BS + offset),
with the value head beside it. Every rounding of the torch ops is kept (the norm's output, cos and
sin, each product and the sum are rounded to the model's dtype, as torch leaves them), so the two
differ only where float32 math functions do (rsqrt, cos, sin) by an ulp.

T tokens, Hq query heads, Hkv key/value heads, D head dim (neox rotary: the halves rotate together), NB cache
blocks of BS positions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def norm_rope_heads(x, xp, w, wp, angle, right, scaling, eps, D, HAS_NORM: tl.constexpr):
    """Heads x [R, BLOCK_D] (xp: each element's rotary partner, the other half's; w, wp: the norm weight
    at both, [1, BLOCK_D]; angle: position x inv_freq, [1, BLOCK_D] float32; right: [1, BLOCK_D], the
    element is in the second half) -> normalized (HAS_NORM) and rotated, in x's dtype, every rounding of
    the torch ops kept."""
    dtype = x.dtype
    if HAS_NORM:
        xf = x.to(tl.float32)
        inv = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)[:, None]
        x = ((xf * inv).to(dtype).to(tl.float32) * w.to(tl.float32)).to(dtype)
        xp = ((xp.to(tl.float32) * inv).to(dtype).to(tl.float32) * wp.to(tl.float32)).to(dtype)
    cos = (tl.cos(angle) * scaling).to(dtype).to(tl.float32)
    sin = (tl.sin(angle) * scaling).to(dtype).to(tl.float32)
    rotated = tl.where(right, xp.to(tl.float32), -xp.to(tl.float32))  # rotate_half
    return ((x.to(tl.float32) * cos).to(dtype).to(tl.float32) + (rotated * sin).to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _norm_rope_kernel(qkv_ptr, q_ptr, k_cache_ptr, v_cache_ptr, q_w_ptr, k_w_ptr, positions_ptr, inv_freq_ptr,
                      token_row_ptr, stride_t, stride_cr, stride_ch, Hq, Hkv, D, scaling, eps,
                      HAS_NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)  # query heads 0..Hq-1, then key heads
    half = D // 2
    cols = tl.arange(0, BLOCK_D)[None, :]  # one head: a [1, BLOCK_D] row
    inside = cols < D
    partner = tl.where(cols < half, cols + half, cols - half)
    row = qkv_ptr + t * stride_t + h * D
    x = tl.load(row + cols, mask=inside, other=0.0)
    xp = tl.load(row + partner, mask=inside, other=0.0)
    w, wp = x, xp  # read only with a norm
    if HAS_NORM:
        is_q = h < Hq
        w = tl.where(is_q, tl.load(q_w_ptr + cols, mask=inside, other=0.0), tl.load(k_w_ptr + cols, mask=inside, other=0.0))
        wp = tl.where(is_q, tl.load(q_w_ptr + partner, mask=inside, other=0.0),
                      tl.load(k_w_ptr + partner, mask=inside, other=0.0))
    angle = tl.load(positions_ptr + t).to(tl.float32) * tl.load(inv_freq_ptr + cols % half, mask=inside, other=0.0)
    y = norm_rope_heads(x, xp, w, wp, angle, cols >= half, scaling, eps, D, HAS_NORM)
    if h < Hq:
        tl.store(q_ptr + (t * Hq + h) * D + cols, y, mask=inside)
    else:
        kh = h - Hq
        at = tl.load(token_row_ptr + t).to(tl.int64) * stride_cr + kh * stride_ch
        tl.store(k_cache_ptr + at + cols, y.to(k_cache_ptr.dtype.element_ty), mask=inside)
        v = tl.load(qkv_ptr + t * stride_t + (Hq + Hkv + kh) * D + cols, mask=inside, other=0.0)
        tl.store(v_cache_ptr + at + cols, v.to(v_cache_ptr.dtype.element_ty), mask=inside)


def check_paged_cache(*caches: torch.Tensor, block_table: torch.Tensor | None = None) -> int:
    """The block size BS of paged caches [NB, BS, ...] (contiguous, of the same NB and BS) that the kernels
    address by flat row (block * BS + offset); block_table: [S, M] int32 if given. ValueError otherwise."""
    NB, BS = caches[0].shape[:2]
    if BS & (BS - 1) or not 16 <= BS <= 256:
        raise ValueError(f"the KV cache's block size must be a power of two from 16 to 256, got {BS}")
    for cache in caches:
        if cache.shape[:2] != (NB, BS) or not cache.is_contiguous():
            raise ValueError(f"a paged KV cache is [{NB}, {BS}, ...] and contiguous, got {tuple(cache.shape)} "
                             f"with strides {cache.stride()}")
    if block_table is not None and (block_table.dtype != torch.int32 or block_table.dim() != 2):
        raise ValueError(f"the block table is [slots, blocks] int32, got {tuple(block_table.shape)} {block_table.dtype}")
    return BS


def triton_norm_rope_cache(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                           q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                           positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float,
                           k_cache: torch.Tensor, v_cache: torch.Tensor, token_row: torch.Tensor) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D] normalized (q_weight not None) and rotated; k likewise and v
    written to k_cache, v_cache [NB, BS, Hkv, D] at the flat rows token_row [T] (block * BS + offset).

    positions [T] (rotary angles: positions x inv_freq [D / 2], float32, on the device), attention_scaling:
    the rope type's factor on cos and sin.
    """
    T = qkv.shape[0]
    check_paged_cache(k_cache, v_cache)
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    q = torch.empty(T, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    has_norm = q_weight is not None
    _norm_rope_kernel[(T, num_heads + num_kv_heads)](
        qkv, q, k_cache, v_cache, q_weight if has_norm else qkv, k_weight if has_norm else qkv, positions, inv_freq,
        token_row, qkv.stride(0), k_cache.stride(1), k_cache.stride(2), num_heads, num_kv_heads, head_dim,
        attention_scaling, eps, HAS_NORM=has_norm, BLOCK_D=triton.next_power_of_2(head_dim))
    return q
