"""Linear layers whose weight is several checkpoint tensors stacked along the output dim.

Fusing q/k/v (or gate/up) into one matmul is done once, at load time: the loader copies
each checkpoint tensor into its row range (`shard_rows`), forward is a plain F.linear.
"""

from __future__ import annotations

import torch
from torch import nn


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
