"""Linear layers split across the ranks of a tensor-parallel group.

- Column-parallel: each rank holds a slice of the output rows (its heads, its share of an MLP's intermediate
  size) and computes its slice of the output; nothing is exchanged. A merged one (q/k/v, gate/up) holds each
  checkpoint tensor's slice for this rank in its row range: its out_sizes are the per-rank sizes, so the loader's
  shard mapping (MergedLinear.shard_rows, weights/loader.py) places each slice as it places a whole tensor.
- Row-parallel: each rank holds a slice of the input columns, computes a partial output from its slice of the
  input (the column-parallel output of the layer before) and the partials are summed over the ranks
  (all-reduce); the bias, held whole on every rank, is added once after the sum.
- The output head, column-parallel by vocabulary: each rank's slice of the logits, gathered into all of them on
  every rank (all-gather).

Each holds its rank's TensorParallel (tp). split_dims says, per parameter, along which dimension the checkpoint's
whole tensor is cut into world_size equal parts of which rank r reads part r (distributed/checkpoint_slices.py); a
parameter it does not name is whole on every rank.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from hybridmoe.distributed.parallel_state import TensorParallel
from hybridmoe.layers.linear import MergedLinear


class ColumnParallelLinear(nn.Linear):
    """This rank's out_features // world_size output rows of an in_features -> out_features linear."""

    split_dims: ClassVar[dict[str, int]] = {"weight": 0, "bias": 0}

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, bias: bool = False):
        super().__init__(in_features, tp.part(out_features, "an output size"), bias=bias)
        self.tp = tp


class ColumnParallelMergedLinear(MergedLinear):
    """A MergedLinear of this rank's slice of each of its checkpoint tensors (out_sizes: the whole tensors').
    shard_parts, where given, names per checkpoint tensor (shard) the consecutive parts it is made of (None: one
    part): each part is cut in world_size and this rank reads its slice of every part (Qwen3.5's in_proj_qkv, all
    q heads, then all k heads, then all v heads)."""

    split_dims: ClassVar[dict[str, int]] = {"weight": 0, "bias": 0}

    def __init__(self, in_features: int, out_sizes: list[int], tp: TensorParallel, bias: bool = False,
                 shard_parts: list[tuple[int, ...] | None] | None = None):
        super().__init__(in_features, [tp.part(n, "an output size") for n in out_sizes], bias=bias)
        self.tp = tp
        self.shard_parts = shard_parts or [None] * len(out_sizes)


class RowParallelLinear(nn.Linear):
    """An in_features -> out_features linear over this rank's in_features // world_size input columns, summed over
    the ranks."""

    split_dims: ClassVar[dict[str, int]] = {"weight": 1}

    def __init__(self, in_features: int, out_features: int, tp: TensorParallel, bias: bool = False):
        super().__init__(tp.part(in_features, "an input size"), out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in / world_size] (this rank's columns) -> [T, out], the same on every rank."""
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelHead(nn.Linear):
    """The output head's vocab_size // world_size rows of this rank; forward gathers every rank's logits."""

    split_dims: ClassVar[dict[str, int]] = {"weight": 0}

    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel):
        super().__init__(hidden_size, tp.part(vocab_size, "the vocabulary"), bias=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H] -> logits [N, V] on every rank (rank r's slice is vocabulary rows r V / world_size onwards)."""
        return self.tp.all_gather(F.linear(x, self.weight))


TENSOR_PARALLEL_LINEARS = (ColumnParallelLinear, ColumnParallelMergedLinear, RowParallelLinear, VocabParallelHead)
"""Every linear type whose parameters are cut across the ranks (each with its split_dims; checkpoint_slices.py
adds the sharded norm)."""
