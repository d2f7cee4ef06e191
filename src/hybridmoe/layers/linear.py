"""Linear layers whose weight is several checkpoint tensors stacked along the output dim, and the
decode steps' linear layers as one Triton GEMV each, with the RMSNorm before them folded in.

Fusing q/k/v (or gate/up) into one matmul is done once, at load time: the loader copies
each checkpoint tensor into its row range (`shard_rows`), forward is a plain F.linear.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridmoe.platform import HAVE_TRITON


class MergedLinear(nn.Linear):
    """One [sum(out_sizes), in] weight holding len(out_sizes) checkpoint tensors."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False):
        super().__init__(in_features, sum(out_sizes), bias=bias)
        self.out_sizes = list(out_sizes)

    def shard_rows(self, shard: int) -> tuple[int, int]:
        """(first row, number of rows) of shard in the merged output dim."""
        return sum(self.out_sizes[:shard]), self.out_sizes[shard]

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(y.split(self.out_sizes, dim=-1))


SMALL_WEIGHT = 1 << 20
"""Weights of at most this many elements (a router's) run the decode GEMV up to SMALL_WEIGHT_MAX_TOKENS."""
SMALL_WEIGHT_MAX_TOKENS = 8


def decode_gemv(x: torch.Tensor, on: bool, linear) -> bool:
    """Whether linear reads x [T, K] as the Triton decode GEMV (gemv_triton.py): on, CUDA, triton, and one
    token, or a few for a small weight. Each token's programs read the whole weight, so a second token
    reads it again (from L2). Against the norm's kernel + cuBLAS it is faster for every weight at T=1 and for
    the router alone at T=4 (router at T=4: 3.69 vs 6.53 us, H200, bf16)."""
    if not (on and HAVE_TRITON and x.is_cuda and x.dim() == 2):
        return False
    T = x.shape[0]
    return T == 1 or (T <= SMALL_WEIGHT_MAX_TOKENS and linear.weight.numel() <= SMALL_WEIGHT)


def norm_linear(x: torch.Tensor, linear: nn.Linear, norm=None, residual: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """linear(norm(x + residual)) as one Triton kernel: (y [T, N], normed [T, K], total = x + residual [T, K]).

    linear: anything with a weight [N, K] (and a bias [N] or None); y comes out in the weight's dtype.
    norm: an RMSNorm (layers/norm.py) or None (y = linear(x); normed and total None); residual None: total
    None. For steps where decode_gemv(x, True, linear) holds.
    """
    from hybridmoe.layers.gemv_triton import triton_norm_gemv

    return triton_norm_gemv(x, linear.weight, getattr(linear, "bias", None), norm.weight if norm is not None else None,
                            norm.eps if norm is not None else 0.0, residual)
