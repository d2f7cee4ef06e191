"""The automatic engine choices, made once per load, the same for run/chat/serve/bench and doctor.

- expert_backend "auto": the native CPU engine when it is built and can hold the model's precision
  (SiLU experts, or the clamped SwiGLU a config declares, and a bf16/fp16 compute dtype, or a directory
  already converted for it); otherwise the torch reference, so a float32 model stays exact.
- expert_format "auto": the native format nearest the checkpoint's (weights/native_format.py).
- gpu_memory_budget None on a GPU with the native engine: 90% of the GPU's free memory, so the
  routed experts the GPU can hold run there and the rest on the CPU.
- prefill_streaming "auto": on when a layer streamed (its packed experts over PCIe at the bandwidth
  measured once per process, overlapped with the device's work on the previous layer) beats the CPU
  (CPU_EXPERT_FLOPS_PER_CORE, an estimate) on a max_num_batched_tokens step, and the device buffers
  fit the budget; then the loader times the CPU engine and the streamed layer itself
  (streamed_prefill.measured_costs), which set, unless prefill_streaming_tokens is given, from how
  many tokens steps stream (or that none do, if the CPU wins every step).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from hybridmoe.config import EngineConfig, uses_hybrid
from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.cpu_experts import available_isas
from hybridmoe.experts.placement import format_bytes, model_footprint
from hybridmoe.experts.streamed_prefill import (
    break_even_tokens,
    device_bytes,
    layer_packed_bytes,
    streamed_layer_seconds,
)
from hybridmoe.models.registry import architecture_of, get_model_class
from hybridmoe.platform import native_engine_built
from hybridmoe.system import bandwidth
from hybridmoe.weights.expert_cache import read_manifest
from hybridmoe.weights.native_format import resolve_expert_format

log = logging.getLogger("hybridmoe")

AUTO_BUDGET_FRACTION = 0.9
"""Of the GPU's free memory at load time: the rest is left to the CUDA context and other processes."""


def resolve_expert_backend(engine_config: EngineConfig, config, dtype: torch.dtype, model_dir: str | Path) -> str:
    if engine_config.expert_backend != "auto":
        return engine_config.expert_backend
    if read_manifest(Path(model_dir)) is not None:
        return "native"
    silu = config.hidden_act in ("silu", "swish") or config.get("expert_glu") is not None
    if not native_engine_built() or not silu or dtype == torch.float32:
        return "torch"
    return "native"


def auto_gpu_budget(engine_config: EngineConfig, config) -> int | None:
    """The budget to plan with: the user's, else (GPU + native engine) a share of the GPU's free memory."""
    if engine_config.gpu_memory_budget is not None or engine_config.gpu_experts_per_layer is not None:
        return engine_config.gpu_memory_budget
    if torch.device(engine_config.device).type == "cuda" and engine_config.expert_backend == "native":
        free, _ = torch.cuda.mem_get_info(torch.device(engine_config.device))
        return int(AUTO_BUDGET_FRACTION * free)
    return None


def check_device(device: str) -> None:
    """A device this torch cannot run on is a user mistake: one line that says which devices it can."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise HybridMoEError(f"device {device!r} is not a device name; use 'cpu', 'cuda', 'cuda:N' or 'auto'") from None
    if dev.type not in ("cpu", "cuda"):
        raise HybridMoEError(f"device {device!r}: hybridmoe runs on 'cpu' or 'cuda' (or 'auto': cuda if present)")
    if dev.type == "cuda" and not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "torch sees no CUDA device"
        raise HybridMoEError(f"device {device!r}: {why} (torch {torch.__version__}); use device 'cpu' or 'auto'")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise HybridMoEError(f"device {device!r}: torch sees {torch.cuda.device_count()} CUDA device(s), "
                             f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")


def resolve_engine_config(engine_config: EngineConfig, config, dtype: torch.dtype,
                          model_dir: str | Path) -> EngineConfig:
    """engine_config with every "auto" replaced by what this machine and model call for."""
    check_device(engine_config.device)
    resolved = replace(engine_config, expert_backend=resolve_expert_backend(engine_config, config, dtype, model_dir))
    resolved = resolve_expert_format(resolved, config, model_dir)
    resolved = replace(resolved, gpu_memory_budget=auto_gpu_budget(resolved, config))
    decision = prefill_streaming_decision(resolved, config, dtype)
    if decision.on is None:
        return resolved
    if not decision.fits:
        log.warning("prefill streaming %s", decision.reason)
    return replace(resolved, prefill_streaming="on" if decision.on else "off",
                   prefill_streaming_tokens=None if decision.measure_at_load else decision.min_tokens)


CPU_EXPERT_FLOPS_PER_CORE = {"amx": 190e9, "avx512": 60e9, "avx2": 25e9, "generic": 5e9}
"""Estimated FLOP/s per core of the native engine's routed experts in long steps, by the best kernel
path. amx: 2.8-3.3 TFLOP/s on 16 cores at T=2048 (`benchmarks/kernel.py moe-layer`, every format); avx512: 59-71
GFLOP/s a core at T=512; avx2 and generic are guesses (fewer, narrower lanes)."""

DEFAULT_STREAMING_TOKENS = 1024
"""prefill_streaming "on" with no PCIe to measure (the CPU device) and no prefill_streaming_tokens."""


@dataclass
class StreamingDecision:
    on: bool | None
    """None: nothing to decide (no hybrid split, or streaming cannot run): the config stays as given."""
    min_tokens: int | None
    reason: str
    """One line for `hybridmoe doctor`."""
    fits: bool = True
    """False: "auto" would stream but the device buffers do not fit the budget (a warning at load)."""
    measure_at_load: bool = False
    """"auto" on, from a token count the loader measures (streamed_prefill.measured_costs) in place
    of min_tokens, the estimate."""


PCIE_MEASURE_BYTES = 256 << 20
"""The pinned copy PCIe is measured over: ~5 ms at gen5's ~55 GB/s, well past a copy's fixed cost."""


@functools.cache
def measured_pcie_bandwidth(device: str) -> float:
    """Pinned host-to-device bytes/s over PCIE_MEASURE_BYTES, measured once per process and device: the
    one figure the streaming choice uses and `hybridmoe doctor` prints."""
    return bandwidth.pinned_h2d_bandwidth(device, PCIE_MEASURE_BYTES)


def estimated_cpu_flops(threads: int | None) -> float:
    """The native engine's FLOP/s for long steps on this CPU (CPU_EXPERT_FLOPS_PER_CORE x threads)."""
    return CPU_EXPERT_FLOPS_PER_CORE[available_isas()[-1]] * (threads or len(os.sched_getaffinity(0)))


def prefill_streaming_decision(ec: EngineConfig, config, dtype: torch.dtype) -> StreamingDecision:
    """Whether (and from how many tokens) steps stream their layers' CPU experts to the device, for
    ec with its other choices already resolved."""
    if not uses_hybrid(ec) or ec.prefill_streaming == "off":
        return StreamingDecision(None, None, "off" if ec.prefill_streaming == "off" else
                                 "off (every routed expert runs where the model runs: no GPU split)")
    if ec.expert_backend != "native":
        if ec.prefill_streaming == "on":
            raise HybridMoEError("prefill_streaming 'on' streams the native engine's packed experts; it needs "
                                 "expert_backend 'native'")
        return StreamingDecision(False, None, "off (the CPU experts are the torch reference, not packed)")
    model_cls = get_model_class(architecture_of(config.to_dict()))  # config keeps config.json's "architectures"
    fp = model_footprint(model_cls, config, dtype, replace(ec, prefill_streaming="off"))
    H, I, K = fp.hidden_size, fp.moe_intermediate_size, fp.top_k
    layer_bytes = layer_packed_bytes(ec.expert_format, fp.num_experts, H, I, ec.expert_group_size_or_default,
                                     bool(ec.expert_zero_points))
    reserve = device_bytes(layer_bytes, fp.num_experts, H, I, K, ec.max_num_batched_tokens)
    if torch.device(ec.device).type != "cuda":
        tokens = ec.prefill_streaming_tokens or DEFAULT_STREAMING_TOKENS
        if ec.prefill_streaming == "on":
            return StreamingDecision(True, tokens, f"on from {tokens} tokens (asked; the device is the CPU)")
        return StreamingDecision(False, None, "off (no GPU)")
    pcie, cpu = measured_pcie_bandwidth(ec.device), estimated_cpu_flops(ec.cpu_threads)
    flops = 2 * 3 * H * I * K
    streamed = streamed_layer_seconds(layer_bytes, 3 * H * I * fp.num_experts, pcie)
    break_even = break_even_tokens(streamed, cpu, flops)
    steps = ec.max_num_batched_tokens
    why = (f"a layer's {format_bytes(layer_bytes)} of packed experts take {1e3 * layer_bytes / pcie:.1f} ms over "
           f"PCIe at {pcie / 1e9:.1f} GB/s, {1e3 * streamed:.1f} ms streamed with the device's share; the CPU "
           f"(~{cpu / 1e12:.2f} TFLOP/s) takes as long at {break_even} "
           f"tokens and {1e3 * steps * flops / cpu:.1f} ms at a {steps}-token step")
    if ec.prefill_streaming == "on":
        tokens = ec.prefill_streaming_tokens or break_even
        return StreamingDecision(True, tokens, f"on from {tokens} tokens (asked): {why}")
    if break_even > steps:
        return StreamingDecision(False, None, f"off: {why}")
    if ec.gpu_memory_budget is not None and fp.fixed_bytes + reserve > ec.gpu_memory_budget:
        return StreamingDecision(False, None, f"off: its device buffers ({format_bytes(reserve)}) do not fit "
                                 f"the budget after the fixed {format_bytes(fp.fixed_bytes)}; {why}", fits=False)
    if ec.prefill_streaming_tokens:
        return StreamingDecision(True, ec.prefill_streaming_tokens, f"on from {ec.prefill_streaming_tokens} "
                                 f"tokens (asked): {why}")
    return StreamingDecision(True, break_even, f"on, from the token count measured at load (estimated "
                             f"{break_even}): {why}", measure_at_load=True)
