"""The automatic engine choices, made once per load, the same for run/chat/serve/bench and doctor.

- expert_backend "auto": the native CPU engine when it is built and can hold the model's precision
  (SiLU experts and a bf16/fp16 compute dtype, or a directory already converted for it); otherwise
  the torch reference, so a float32 model stays exact.
- expert_format "auto": the native format nearest the checkpoint's (weights/native_format.py).
- gpu_memory_budget None on a GPU with the native engine: 90% of the GPU's free memory, so the
  routed experts the GPU can hold run there and the rest on the CPU.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from hybridmoe.config import EngineConfig

AUTO_BUDGET_FRACTION = 0.9
"""Of the GPU's free memory at load time: the rest is left to the CUDA context and other processes."""


def native_engine_built() -> bool:
    try:
        from hybridmoe import _native  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_expert_backend(engine_config: EngineConfig, config, dtype: torch.dtype, model_dir: str | Path) -> str:
    if engine_config.expert_backend != "auto":
        return engine_config.expert_backend
    from hybridmoe.weights.expert_cache import read_manifest

    if read_manifest(Path(model_dir)) is not None:
        return "native"
    if not native_engine_built() or config.hidden_act not in ("silu", "swish") or dtype == torch.float32:
        return "torch"
    return "native"


def auto_gpu_budget(engine_config: EngineConfig) -> int | None:
    """The budget to plan with: the user's, else (GPU + native engine) a share of the GPU's free memory."""
    if engine_config.gpu_memory_budget is not None or engine_config.gpu_experts_per_layer is not None:
        return engine_config.gpu_memory_budget
    if torch.device(engine_config.device).type == "cuda" and engine_config.expert_backend == "native":
        free, _ = torch.cuda.mem_get_info(torch.device(engine_config.device))
        return int(AUTO_BUDGET_FRACTION * free)
    return None


def resolve_engine_config(engine_config: EngineConfig, config, dtype: torch.dtype,
                          model_dir: str | Path) -> EngineConfig:
    """engine_config with every "auto" replaced by what this machine and model call for."""
    from hybridmoe.weights.native_format import resolve_expert_format

    resolved = replace(engine_config, expert_backend=resolve_expert_backend(engine_config, config, dtype, model_dir))
    resolved = resolve_expert_format(resolved, config, model_dir)
    return replace(resolved, gpu_memory_budget=auto_gpu_budget(resolved))


def uses_hybrid(engine_config: EngineConfig) -> bool:
    """Whether the routed experts are split between the GPU and the CPU (or deferred)."""
    return (engine_config.gpu_memory_budget is not None or engine_config.gpu_experts_per_layer is not None
            or engine_config.deferred_experts > 0)
