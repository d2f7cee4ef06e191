"""What tensor parallelism runs and what it refuses, decided on rank 0 before any worker starts; and the engine
options a rank loads with.

Refused, each with a one-line error: the hybrid GPU/CPU expert split (gpu_memory_budget, gpu_experts_per_layer,
deferred_experts: every routed expert runs in rank 0's expert engine), a LoRA adapter (merged into whole weights),
the multi-token-prediction module, the host tier of the KV cache (kv_cpu_budget above 0: each rank would need its
copies), more ranks than CUDA devices, a CUDA device other than cuda:0 for rank 0, a second group in one process
(torch.distributed has one default group), and any model whose layers distributed/shard.py does not split (checked
by splitting the model built on the meta device).

Not refused but not used: CUDA graphs and fixed-shape decode steps (a tensor-parallel step runs eagerly: its inputs
reach the other ranks from the host), and on CUDA the GPU share of the routed experts that "auto" would plan.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from hybridmoe.config import EngineConfig, uses_hybrid
from hybridmoe.distributed.experts import ReceivedExperts
from hybridmoe.distributed.parallel_state import TensorParallel, check_not_in_group
from hybridmoe.distributed.shard import shard_model
from hybridmoe.errors import HybridMoEError
from hybridmoe.models.registry import load_config


def tensor_parallel_options(engine_config: EngineConfig) -> EngineConfig:
    """engine_config as a tensor-parallel group runs it (no host tier of the KV cache), or a one-line error for an
    option it does not run with (the module docstring)."""
    check_not_in_group()
    world = engine_config.tensor_parallel_size
    refused = None
    if uses_hybrid(engine_config):
        refused = ("the hybrid GPU/CPU expert split (gpu_memory_budget, gpu_experts_per_layer, deferred_experts); "
                   "every routed expert runs in rank 0's expert engine")
    elif engine_config.lora:
        refused = "a LoRA adapter (lora)"
    elif engine_config.mtp:
        refused = "the multi-token-prediction module (mtp)"
    elif engine_config.kv_cpu_budget:
        refused = "the KV cache's host tier (kv_cpu_budget above 0)"
    if refused is not None:
        raise HybridMoEError(f"tensor_parallel_size {world} does not run with {refused}; leave it out or run with "
                             "tensor_parallel_size 1")
    device = torch.device(engine_config.device)
    if device.type == "cuda" and device.index not in (None, 0):
        raise HybridMoEError(f"with tensor_parallel_size {world}, rank r runs on cuda:r; give device 'cuda', not "
                             f"{engine_config.device!r}")
    if device.type == "cuda" and torch.cuda.device_count() < world:
        raise HybridMoEError(f"tensor_parallel_size {world} needs {world} CUDA devices (one per rank); torch sees "
                             f"{torch.cuda.device_count()}")
    return dataclasses.replace(engine_config, kv_cpu_budget=0)


def check_model_splits(model_dir: Path, world_size: int) -> None:
    """The model of model_dir built on the meta device and split for world_size ranks: a one-line error for a
    layer or a size that does not split (nothing is allocated or read but config.json)."""
    cls, config = load_config(model_dir)
    tp = TensorParallel(0, world_size, torch.device("meta"))
    with torch.device("meta"):
        shard_model(cls(config, ReceivedExperts(tp)), tp)


def rank_engine_config(resolved: EngineConfig) -> EngineConfig:
    """A rank's resolved options: no GPU share of the routed experts (what "auto" may plan on CUDA), no prefill
    streaming (which only streams that split's CPU share)."""
    return dataclasses.replace(resolved, gpu_memory_budget=None, prefill_streaming="off")
