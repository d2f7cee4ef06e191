"""RMSNorm, and residual add + RMSNorm, as one Triton kernel each (decode steps on CUDA).

In a decode step every kernel costs its launch and drain even inside a CUDA graph, and torch runs
an RMSNorm as ~8 (cast, square, mean, add, rsqrt, multiply, cast, scale); this is 1. Same
arithmetic as layers/norm.py: normalize in float32, round to the input dtype, scale by the
weight (the product rounded once to the output dtype); the residual sum is rounded to its
dtype before it is normalized, as torch's separate add would leave it.

Rows: x [N0, N1, D] with any row strides (q/k heads are views into the merged qkv output); N
rows = N0 * N1, D normalized elements each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, N1, D, eps,
                     stride_x0, stride_x1, stride_r0, stride_r1,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr):
    """One row: out = rms_norm(x (+ residual)) * w; with a residual also sum = x + residual."""
    r = tl.program_id(0)
    r0, r1 = r // N1, r % N1
    cols = tl.arange(0, BLOCK_D)
    inside = cols < D
    x = tl.load(x_ptr + r0 * stride_x0 + r1 * stride_x1 + cols, mask=inside, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + r0 * stride_r0 + r1 * stride_r1 + cols, mask=inside, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)  # rounded like torch's add
        tl.store(sum_ptr + r * D + cols, x, mask=inside)
    xf = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
    normed = (xf * inv).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * D + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=inside)


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, int, int, int, int]:
    """t [..., D] as (t, N0, N1, stride 0, stride 1) with the last dim contiguous and at most two leading dims."""
    if t.stride(-1) != 1 or t.dim() > 3:
        t = t.contiguous()
    if t.dim() == 3:
        return t, t.shape[0], t.shape[1], t.stride(0), t.stride(1)
    t2 = t.reshape(-1, t.shape[-1])
    return t2, t2.shape[0], 1, t2.stride(0), 0


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rms_norm(x + residual) * weight, x + residual) in one kernel; residual None: (rms_norm(x) * weight, None).

    x, residual [..., D] (same shape and dtype); weight [D]. The norm comes out in the dtype torch
    would give weight * x (its promotion), the sum in x's dtype, both contiguous.
    """
    D = x.shape[-1]
    xr, N0, N1, sx0, sx1 = _rows(x)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is None:
        rr, sr0, sr1, total = xr, 0, 0, None
    else:
        rr, _, _, sr0, sr1 = _rows(residual)
        total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _rms_norm_kernel[(N0 * N1,)](
        xr, rr, weight, out, total if total is not None else out, N1, D, eps, sx0, sx1, sr0, sr1,
        HAS_RESIDUAL=residual is not None, BLOCK_D=triton.next_power_of_2(D))
    return out, total
