"""A checkpoint as one tensor-parallel rank reads it: each tensor that fills a split parameter comes as this rank's
slice of it, every other tensor as it is.

The loader (weights/loader.py) then fills a sharded model as it fills a whole one: the shapes it checks and the
tensors it copies are this rank's, and a merged parameter's shard (q/k/v, gate/up) takes this rank's slice of each of
its checkpoint tensors into its row range. Which tensors are split, and along which dimension, comes from the
model's split layers (split_dims of distributed/sharded_linear.py's linears and distributed/sharded_norm.py's norm),
from each attention split by heads (its sinks, one per query head) and from each Gated DeltaNet split by heads (its
convolution's channels, cut per part: q, k and v; its dt_bias and A_log, one per value head). Each rank reads the
whole tensor of a split parameter from the mapped file and keeps its slice (a dequantized format is dequantized whole
first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridmoe.distributed.sharded_linear import (
    TENSOR_PARALLEL_LINEARS,
    ColumnParallelMergedLinear,
    RowParallelLinear,
)
from hybridmoe.distributed.sharded_norm import ShardedRMSNorm
from hybridmoe.layers.attention import Attention
from hybridmoe.layers.linear_attention import GatedDeltaNet
from hybridmoe.models.base import MoECausalLM

SPLIT_MODULES = (*TENSOR_PARALLEL_LINEARS, ShardedRMSNorm)
"""The module types whose parameters are cut across the ranks as their split_dims say."""


@dataclass(frozen=True)
class Split:
    """A checkpoint tensor cut along dim into world equal parts of which rank reads its own; with parts (the sizes
    of the tensor's consecutive parts along dim), each part is cut so, and the rank's slices are joined in order."""

    dim: int
    rank: int
    world: int
    parts: tuple[int, ...] | None = None

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The rank's slice's shape of a tensor of shape (shape itself where it is not cut evenly: the loader names
        it against the shape it expects)."""
        whole = shape[self.dim]
        if whole % self.world or (self.parts is not None
                                  and (sum(self.parts) != whole or any(p % self.world for p in self.parts))):
            return shape
        return shape[:self.dim] + (whole // self.world,) + shape[self.dim + 1:]

    def slice(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.parts is None:
            return tensor.chunk(self.world, self.dim)[self.rank]
        return torch.cat([part.chunk(self.world, self.dim)[self.rank]
                          for part in tensor.split(list(self.parts), self.dim)], dim=self.dim)


def split_parameters(model: MoECausalLM) -> dict[tuple[str, int | None], Split]:
    """(parameter name, shard) -> Split of every parameter cut across the ranks (shard None: every checkpoint tensor
    of the parameter; an int: the merged parameter's shard of that index, where it has parts): those of the split
    modules, the sinks [Hq] of an attention whose q/k/v are split by heads (cut as its query heads are), and a
    split Gated DeltaNet's conv1d.weight [Ch, 1, K] (per part: all q, all k, all v heads), dt_bias and A_log [Hv]."""
    splits = {}
    for name, module in model.named_modules():
        if isinstance(module, SPLIT_MODULES):
            tp = module.tp
            for param, dim in module.split_dims.items():
                if getattr(module, param) is not None:
                    splits[f"{name}.{param}", None] = Split(dim, tp.rank, tp.world_size)
            if isinstance(module, ColumnParallelMergedLinear):
                for shard, parts in enumerate(module.shard_parts):
                    if parts is not None:
                        splits[f"{name}.weight", shard] = Split(0, tp.rank, tp.world_size, parts)
        elif (isinstance(module, Attention) and module.sinks is not None
              and isinstance(module.qkv_proj, ColumnParallelMergedLinear)):
            tp = module.qkv_proj.tp
            splits[f"{name}.sinks", None] = Split(0, tp.rank, tp.world_size)
        elif isinstance(module, GatedDeltaNet) and isinstance(module.out_proj, RowParallelLinear):
            tp = module.out_proj.tp
            w = tp.world_size
            q = module.num_k_heads * module.k_dim * w  # the whole layer's q (and k) channels
            splits[f"{name}.conv1d.weight", None] = Split(0, tp.rank, w, (q, q, module.num_v_heads * module.v_dim * w))
            for param in ("dt_bias", "A_log"):
                splits[f"{name}.{param}", None] = Split(0, tp.rank, w)
    return splits


class RankCheckpoint:
    """ckpt with shape() and get() giving this rank's slice of every tensor that fills a split parameter of model;
    every other attribute is ckpt's."""

    def __init__(self, ckpt, model: MoECausalLM):
        self._ckpt, self._model = ckpt, model
        self._splits = split_parameters(model)

    def __getattr__(self, name: str):
        return getattr(self._ckpt, name)

    def _split(self, name: str) -> Split | None:
        param, shard = self._model.param_target(name)
        return self._splits.get((param, shard)) or self._splits.get((param, None))

    def shape(self, name: str) -> tuple[int, ...]:
        shape = tuple(self._ckpt.shape(name))
        split = self._split(name)
        return shape if split is None else split.shape(shape)

    def get(self, name: str) -> torch.Tensor:
        tensor = self._ckpt.get(name)
        split = self._split(name)
        return tensor if split is None else split.slice(tensor)
