"""A checkpoint as one tensor-parallel rank reads it: each tensor that fills a split parameter comes as this rank's
slice of it, every other tensor as it is.

The loader (weights/loader.py) then fills a sharded model as it fills a whole one: the shapes it checks and the
tensors it copies are this rank's, and a merged parameter's shard (q/k/v, gate/up) takes this rank's slice of each of
its checkpoint tensors into its row range. Which tensors are split, and along which dimension, comes from the
model's split layers (split_dims of distributed/sharded_linear.py's linears and distributed/sharded_norm.py's norm)
and from each attention split by heads (its sinks, one per query head). Each rank reads the whole tensor of a split
parameter from the mapped file and keeps its slice (a dequantized format is dequantized whole first).
"""

from __future__ import annotations

import torch

from hybridmoe.distributed.sharded_linear import TENSOR_PARALLEL_LINEARS, ColumnParallelMergedLinear
from hybridmoe.distributed.sharded_norm import ShardedRMSNorm
from hybridmoe.layers.attention import Attention
from hybridmoe.models.base import MoECausalLM

SPLIT_MODULES = (*TENSOR_PARALLEL_LINEARS, ShardedRMSNorm)
"""The module types whose parameters are cut across the ranks as their split_dims say."""


def split_parameters(model: MoECausalLM) -> dict[str, tuple[int, int, int]]:
    """Parameter name -> (dimension, rank, world size) of every parameter cut across the ranks: those of the split
    modules, and the sinks [Hq] of an attention whose q/k/v are split by heads (cut as its query heads are)."""
    splits = {}
    for name, module in model.named_modules():
        if isinstance(module, SPLIT_MODULES):
            for param, dim in module.split_dims.items():
                if getattr(module, param) is not None:
                    splits[f"{name}.{param}"] = (dim, module.tp.rank, module.tp.world_size)
        elif (isinstance(module, Attention) and module.sinks is not None
              and isinstance(module.qkv_proj, ColumnParallelMergedLinear)):
            tp = module.qkv_proj.tp
            splits[f"{name}.sinks"] = (0, tp.rank, tp.world_size)
    return splits


class RankCheckpoint:
    """ckpt with shape() and get() giving this rank's slice of every tensor that fills a split parameter of model;
    every other attribute is ckpt's."""

    def __init__(self, ckpt, model: MoECausalLM):
        self._ckpt, self._model = ckpt, model
        self._splits = split_parameters(model)

    def __getattr__(self, name: str):
        return getattr(self._ckpt, name)

    def _split(self, name: str) -> tuple[int, int, int] | None:
        return self._splits.get(self._model.param_target(name)[0])

    def shape(self, name: str) -> tuple[int, ...]:
        shape = tuple(self._ckpt.shape(name))
        split = self._split(name)
        if split is None or shape[split[0]] % split[2]:
            return shape  # whole, or not cut evenly: the loader names it against the shape it expects
        dim, _, world = split
        return shape[:dim] + (shape[dim] // world,) + shape[dim + 1:]

    def get(self, name: str) -> torch.Tensor:
        tensor = self._ckpt.get(name)
        split = self._split(name)
        if split is None:
            return tensor
        dim, rank, world = split
        return tensor.chunk(world, dim)[rank]
