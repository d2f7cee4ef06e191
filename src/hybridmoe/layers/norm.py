"""RMSNorm as Llama-family checkpoints define it: normalize in float32, scale in the input dtype.

On CUDA with triton and `fused` (MoECausalLM.fuse_decode_kernels) it runs as one kernel
(norm_triton.py), with the residual add before it folded in when a residual is passed; elsewhere,
and with fused False, as the torch ops below (the reference, and what the CPU runs).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridmoe.platform import HAVE_TRITON


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.fused = True

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [..., D] -> norm(x); with residual [..., D]: (norm(x + residual), x + residual)."""
        if self.fused and HAVE_TRITON and x.is_cuda:
            from hybridmoe.layers.norm_triton import triton_rms_norm

            out, total = triton_rms_norm(x, self.weight, self.eps, residual)
            return out if residual is None else (out, total)
        if residual is None:
            return self._norm(x)
        total = x + residual
        return self._norm(total), total

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm whose scale is 1 + weight, the weight stored centred on zero (Qwen3-Next, Gemma): normalize and
    scale in float32, then round to the input dtype once (where RMSNorm rounds before scaling). Torch ops on every
    device: the Triton norm kernels scale by the weight itself."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [..., D] -> norm(x); with residual [..., D]: (norm(x + residual), x + residual)."""
        if residual is None:
            return self._norm(x)
        total = x + residual
        return self._norm(total), total

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)
