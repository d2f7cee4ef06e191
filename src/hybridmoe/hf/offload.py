"""offload_experts: a loaded transformers MoE model's routed experts moved, in place, into the native CPU engine.

Each MoE layer's Experts module (family_layouts.py names its class per family) is packed into a CpuExperts, one
expert at a time through a float32 staging copy of that expert alone, then replaced in its parent by an
OffloadedExperts (offloaded_experts.py) and its parameters deleted, layer by layer, so the model's own experts
and the packed ones overlap by one layer at most. Everything else stays the model's: router, shared experts,
attention, norms, hooks, generate().

Shapes: E experts, H hidden, I expert intermediate size.
"""

from __future__ import annotations

import torch

from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.cpu_experts import CpuExperts
from hybridmoe.hf.family_layouts import Family, family_of
from hybridmoe.hf.offloaded_experts import OffloadedExperts
from hybridmoe.platform import native_engine_built


def offload_experts(model: torch.nn.Module, expert_format: str = "bf16", cpu_threads: int | None = None,
                    expert_group_size: int | None = None, cpu_isa: str | None = None) -> torch.nn.Module:
    """Replace, in place, every routed-experts module of a transformers MoE model (Qwen2-MoE, Qwen3-MoE, Mixtral,
    DeepSeek-V2, DeepSeek-V3, GLM-4.5, gpt-oss, MiniMax-M2; transformers 5's fused Experts modules) with an
    OffloadedExperts that runs them in the native CPU expert engine, and free their original weights.

    expert_format: "bf16", "int8", "int4", "fp8" or "mxfp4" (CpuExperts' formats); cpu_threads: each layer's
    worker pool (default: every CPU this process may use); expert_group_size: int4's group (default 128); cpu_isa:
    the kernel path, "generic", "avx2", "avx512" or "amx" (default: the fastest this CPU has; available_isas()).
    The experts compute on the CPU: where the model's other weights sit on a GPU, each layer's activations cross
    to the CPU and back. Returns the model.
    """
    require_native_engine()
    family = family_of(getattr(model, "config", None), type(model).__name__)
    names = [name for name, module in model.named_modules() if type(module).__name__ == family.experts_class]
    if not names:
        raise HybridMoEError(no_experts_message(model, family))
    options = packing_options(expert_format, cpu_threads, expert_group_size, cpu_isa)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        module = getattr(parent, child)
        experts = pack_experts_module(module, family, options)
        setattr(parent, child, OffloadedExperts.holding(experts, getattr(module, "config", None)))
        for param, _ in list(module.named_parameters(recurse=False)):
            delattr(module, param)  # freed now, even where something else still holds the module
    return model


def pack_experts_module(module: torch.nn.Module, family: Family, options: dict) -> CpuExperts:
    """One transformers Experts module's experts packed for the native engine (with gpt-oss's biases and clamped
    SwiGLU)."""
    layout = family.layout
    glu = layout.glu(module, family.name)
    parts = {name: getattr(module, name) for name in layout.parts}
    E = layout.dims(parts)[0]
    with torch.no_grad():
        experts = CpuExperts.from_experts((layout.expert(parts, e) for e in range(E)), E, **options)
        biases = layout.biases(parts)
        if biases is not None:
            experts.set_biases(*biases)
    if glu is not None:
        experts.set_glu(glu)
    return experts


def packing_options(expert_format: str, cpu_threads: int | None, expert_group_size: int | None,
                    cpu_isa: str | None = None) -> dict:
    """CpuExperts' keyword arguments for these offload options (its own defaults where None)."""
    options = {"format": expert_format, "threads": cpu_threads, "isa": cpu_isa}
    if expert_group_size is not None:
        options["group_size"] = expert_group_size
    return options


def require_native_engine() -> None:
    if not native_engine_built():
        raise HybridMoEError("hybridmoe.hf runs experts in the native CPU expert engine, which is not built on this "
                             "install (hybridmoe._native does not import); reinstall with "
                             "`pip install --no-build-isolation -e .`")


def no_experts_message(model: torch.nn.Module, family: Family) -> str:
    what = type(model).__name__
    if any(isinstance(m, OffloadedExperts) for m in model.modules()):
        return f"{what}'s routed experts are already offloaded (its MoE layers hold OffloadedExperts)"
    import transformers

    return (f"{what} holds no {family.experts_class} module: hybridmoe.hf reads transformers 5's fused "
            f"Experts modules, and this is transformers {transformers.__version__}")
