"""An RMSNorm over a vector split across the ranks of a tensor-parallel group (MiniMax-M2's q_norm and k_norm).

MiniMax-M2 normalizes all of q's heads together ([Hq D]) and all of k's ([Hkv D]) before they split into heads.
With the heads split by rank each rank holds its Hq / world_size heads' slice of every row, so the mean of squares
it needs is over every rank's slice: each rank sums the squares of its slice (float32), the sums are all-reduced
and divided by the whole size, and each rank scales its slice by its slice of the norm's weight. The result is the
rank's slice of what the whole RMSNorm (layers/norm.py) gives, rounded as it rounds.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from hybridmoe.distributed.parallel_state import TensorParallel


class ShardedRMSNorm(nn.Module):
    """This rank's size // world_size slice of an RMSNorm over size features: weight [size / world_size]."""

    split_dims: ClassVar[dict[str, int]] = {"weight": 0}

    def __init__(self, size: int, eps: float, tp: TensorParallel):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(tp.part(size, "a norm's size")))
        self.size, self.eps, self.tp = size, eps, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, size / world_size] (this rank's slice of each row) -> its slice of RMSNorm(whole row) [T, size /
        world_size]; one all-reduce of T float32 sums."""
        xf = x.float()
        squares = self.tp.all_reduce(xf.pow(2).sum(-1, keepdim=True))
        xf = xf * torch.rsqrt(squares / self.size + self.eps)
        return self.weight * xf.to(x.dtype)
