"""A decode step's linear layer as one Triton GEMV, with the RMSNorm before it (and its residual add) folded in.

At batch 1 a linear layer is a GEMV: bound by reading its weight, but cuBLAS runs it as a tensor-core GEMM
tile (one row used of 64) and, for a long K, as two kernels (split-K, then a reduce). Each program here
reads BLOCK_N whole weight rows for one token. With a norm, every program first normalizes its token's
row itself (one read of K elements, from L2 after the first program), so the norm costs no kernel of its
own; the programs of column block 0 also write the normed row and the residual sum for the layers after.

Same arithmetic as layers/norm.py then F.linear: the residual sum is rounded to x's dtype, normalized in
float32, rounded to x's dtype, scaled by the norm weight and rounded again; the products accumulate in
float32 and the output is rounded once. Only the order of the float32 sum differs from cuBLAS.

T tokens, K input features, N output features; x [T, K] (row stride free, last dim contiguous), w [N, K].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_gemv_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, xn_ptr, sum_ptr,
                      N, K, eps, stride_x, stride_r, stride_w,
                      NORM: tl.constexpr, RESIDUAL: tl.constexpr, BIAS: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_ROW: tl.constexpr):
    """Program (n, t): y[t, n*BLOCK_N : (n+1)*BLOCK_N] = norm(x[t] (+ res[t])) @ w[rows].T (+ b)."""
    pid_n, t = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    dtype = x_ptr.dtype.element_ty
    inv = 1.0
    if NORM:  # the whole row at once: its mean square (names apart from the loop's, whose shapes differ)
        whole = tl.arange(0, BLOCK_ROW)
        row = tl.load(x_ptr + t * stride_x + whole, mask=whole < K, other=0.0)
        if RESIDUAL:
            row = (row.to(tl.float32) + tl.load(res_ptr + t * stride_r + whole, mask=whole < K,
                                                other=0.0).to(tl.float32)).to(dtype)
        rf = row.to(tl.float32)
        inv = tl.math.rsqrt(tl.sum(rf * rf, axis=0) / K + eps)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # summed over K once, after the loop
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        ok = cols < K
        x = tl.load(x_ptr + t * stride_x + cols, mask=ok, other=0.0)
        if NORM:
            if RESIDUAL:
                x = (x.to(tl.float32) + tl.load(res_ptr + t * stride_r + cols, mask=ok, other=0.0).to(tl.float32)).to(dtype)
                if pid_n == 0:
                    tl.store(sum_ptr + t * K + cols, x, mask=ok)
            normed = (x.to(tl.float32) * inv).to(dtype).to(tl.float32)
            nw = tl.load(nw_ptr + cols, mask=ok, other=0.0).to(tl.float32)
            x = (normed * nw).to(xn_ptr.dtype.element_ty)
            if pid_n == 0:
                tl.store(xn_ptr + t * K + cols, x, mask=ok)
        w = tl.load(w_ptr + rows[:, None] * stride_w + cols[None, :], mask=row_ok[:, None] & ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * N + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def default_blocks(n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an [n, k] weight: enough programs to cover the SMs several times, each
    reading 8-16 KB of weights per step; a router's few rows one per program, its whole row in one step, and a
    long row (k >= 4096) of a wide layer 16 KB per step on 8 warps. Against 2 / 4 rows per program at 512 per
    step on 4 warps: Qwen3's router 2.72 vs 3.45 us, its o_proj 6.71 vs 7.69 (H200, bf16, T=1)."""
    if n <= 256:
        return 1, min(2048, triton.next_power_of_2(k)), 4
    if n >= 2048 and k >= 4096:
        return 8, 1024, 8
    return (4 if n <= 2048 else 8), 512, 4


def triton_norm_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     norm_weight: torch.Tensor | None = None, eps: float = 0.0, residual: torch.Tensor | None = None,
                     blocks: tuple[int, int, int] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(y, normed, total): total = x + residual, normed = rms_norm(total) * norm_weight, y = normed @ weight.T + bias.

    x, residual [T, K] (same dtype); weight [N, K] contiguous; bias [N]; norm_weight [K] (None: no norm,
    y = x @ weight.T + bias, normed and total None; residual None: total None). blocks: (BLOCK_N,
    BLOCK_K, num_warps), default_blocks if None. y in weight's dtype, normed in torch's promotion of
    norm_weight and x, total in x's dtype.
    """
    T, K = x.shape
    N = weight.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    block_n, block_k, warps = blocks or default_blocks(N, K)
    y = torch.empty(T, N, dtype=weight.dtype, device=x.device)
    norm = norm_weight is not None
    normed = torch.empty(T, K, dtype=torch.promote_types(norm_weight.dtype, x.dtype), device=x.device) if norm else None
    total = torch.empty_like(x) if norm and residual is not None else None
    res = residual if total is not None else x
    _norm_gemv_kernel[(triton.cdiv(N, block_n), T)](
        x, res, norm_weight if norm else weight, weight, bias if bias is not None else weight, y,
        normed if norm else y, total if total is not None else y, N, K, eps, x.stride(0), res.stride(0),
        weight.stride(0), NORM=norm, RESIDUAL=total is not None, BIAS=bias is not None,
        BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_ROW=triton.next_power_of_2(K) if norm else 16, num_warps=warps)
    return y, normed, total
