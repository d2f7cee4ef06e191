"""Whether this machine can hold the weights a config.json describes, checked before anything is allocated.

A config that asks for a million layers or a hidden size of a billion would otherwise build for minutes and grow
by gigabytes before the allocator fails. The weights are sized from the config alone (models/param_count.py) at
their smallest: the model's own parameters in the compute dtype, the routed experts at 4 bits (the smallest
format the engine packs), or none for a converted directory, whose packed experts are mapped file pages. More
than the machine's memory (MemTotal, plus the GPU's when the model runs on one) is one line with the figures.
Only a load that can never fit is refused here; the packed experts against the memory free now are
expert_memory.py's check, once their format is known.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybridmoe.config import format_bytes
from hybridmoe.errors import HybridMoEError
from hybridmoe.models.base import ModelConfig, MoECausalLM
from hybridmoe.models.param_count import param_count
from hybridmoe.system.host import meminfo
from hybridmoe.weights.expert_cache import read_manifest

MIN_EXPERT_BITS = 4


def weights_floor(cls: type[MoECausalLM], config: ModelConfig, dtype: torch.dtype,
                  experts_mapped: bool) -> tuple[int, int]:
    """(bytes of the model's parameters in dtype, bytes of the routed experts at their smallest)."""
    count = param_count(cls, config)
    experts = 0 if experts_mapped else count.routed_experts * MIN_EXPERT_BITS // 8
    return count.model * dtype.itemsize, experts


def gpu_memory(device: str) -> int:
    """Total bytes of the CUDA device the model runs on; 0 for the CPU or a device torch cannot see."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        return 0
    if dev.type != "cuda" or not torch.cuda.is_available():
        return 0
    index = torch.cuda.current_device() if dev.index is None else dev.index
    return torch.cuda.get_device_properties(index).total_memory if index < torch.cuda.device_count() else 0


def check_weights_fit(model_dir: Path, cls: type[MoECausalLM], config: ModelConfig, dtype: torch.dtype,
                      device: str) -> None:
    """A HybridMoEError when config.json's weights, at their smallest, exceed this machine's memory."""
    ram, _ = meminfo()
    if ram == 0:  # no /proc/meminfo: nothing to check against
        return
    gpu = gpu_memory(device)
    model_bytes, expert_bytes = weights_floor(cls, config, dtype, read_manifest(model_dir) is not None)
    if model_bytes + expert_bytes <= ram + gpu:
        return
    experts = f", {_size(expert_bytes)} of routed experts at {MIN_EXPERT_BITS} bits" if expert_bytes else ""
    where = f"{_size(ram)} of memory" + (f" and {_size(gpu)} on {device}" if gpu else "")
    c = config
    raise HybridMoEError(
        f"{model_dir / 'config.json'} describes at least {_size(model_bytes + expert_bytes)} of weights "
        f"({_size(model_bytes)} in {str(dtype).removeprefix('torch.')} besides the routed experts{experts}), more "
        f"than this machine's {where}; check its sizes (num_hidden_layers {c.num_hidden_layers}, hidden_size "
        f"{c.hidden_size}, vocab_size {c.vocab_size}, ...)")


def _size(n: int) -> str:
    return format_bytes(n) if n < 1 << 80 else f"~2^{n.bit_length() - 1} B"


def check_kv_fits(plan, device: str) -> None:
    """A HybridMoEError when the KV cache (kv_plan.KVPlan), before it is allocated, exceeds the memory it goes to:
    the host's available memory for a cache on the CPU and for the host tier; the GPU's free memory for a cache
    there (a GPU budget's placement has already counted it against the budget)."""
    _, available = meminfo()
    host_tier = plan.host_blocks * plan.block_size * plan.bytes_per_token
    on_host = host_tier + (plan.bytes if torch.device(device).type == "cpu" else 0)
    if available and on_host > available:
        raise HybridMoEError(
            f"the KV cache needs {format_bytes(on_host)} of host memory ({format_bytes(plan.bytes)} of cache"
            f"{f', {format_bytes(host_tier)} of host tier' if host_tier else ''}) and {format_bytes(available)} is "
            "available; lower --kv-cache-budget or --kv-cpu-budget")
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        if plan.bytes > free:
            raise HybridMoEError(f"the KV cache needs {format_bytes(plan.bytes)} of GPU memory and "
                                 f"{format_bytes(free)} is free; lower --kv-cache-budget")
