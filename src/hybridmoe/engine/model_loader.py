"""Model directory -> a ready model: config, resolved engine options, module tree, weights and the routed
experts' backend.

Before anything is built, the config is checked (models/config_check.py, in load_config), its weights are set
against the machine's memory (system/model_memory.py) and its layer count against the checkpoint's tensors.
The model is built on the meta device (no memory, no random init), materialized empty on the target device in
the target dtype, then filled from the checkpoint (weights/loader.py) or, for the routed experts, from a
converted directory or the expert cache when one holds them packed. A LoRA adapter (EngineConfig.lora) is checked
against the built model before the weights load and merged into them once they have (weights/lora.py).

Under tensor parallelism (a rank's TensorParallel given), the model built on the meta device is split into the rank's
shard before it is materialized (distributed/shard.py) and reads its slice of each split tensor
(distributed/checkpoint_slices.py); rank 0's backend holds every routed expert, the other ranks' none
(distributed/experts.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridmoe.config import EngineConfig, check_max_model_len, uses_hybrid
from hybridmoe.distributed.checkpoint_slices import RankCheckpoint
from hybridmoe.distributed.checks import rank_engine_config
from hybridmoe.distributed.experts import RankZeroExperts, ReceivedExperts
from hybridmoe.distributed.parallel_state import TensorParallel
from hybridmoe.distributed.shard import shard_model
from hybridmoe.errors import CheckpointError, HybridMoEError
from hybridmoe.experts.base import ExpertBackend
from hybridmoe.experts.factory import make_expert_backend
from hybridmoe.experts.streamed_prefill import attach as attach_prefill_streamer
from hybridmoe.models.base import ModelConfig, MoECausalLM
from hybridmoe.models.mtp import enable_mtp
from hybridmoe.models.registry import load_config
from hybridmoe.system.auto import resolve_engine_config
from hybridmoe.system.expert_memory import check_expert_memory
from hybridmoe.system.model_memory import check_weights_fit
from hybridmoe.weights.expert_cache import read_manifest
from hybridmoe.weights.expert_cache_policy import PackedExperts, plan_packed_experts
from hybridmoe.weights.gguf_model_dir import resolve_model_path
from hybridmoe.weights.loader import load_weights, resolve_dtype
from hybridmoe.weights.lora import plan_lora
from hybridmoe.weights.native_format import check_int4_group
from hybridmoe.weights.quantized import open_checkpoint


@dataclass
class LoadedModel:
    model: MoECausalLM
    """In eval mode, on engine_config.device, in `dtype`, no gradients."""
    config: ModelConfig
    experts: ExpertBackend
    """Holds the routed experts of every MoE layer (model.experts is the same object)."""
    dtype: torch.dtype
    engine_config: EngineConfig
    """The options the load ran with, every "auto" resolved (what the reports print as the choices)."""


def _expert_placement(engine_config: EngineConfig, dtype: torch.dtype) -> tuple[torch.device, torch.dtype]:
    # The native engine and the hybrid split read experts from CPU memory (the hybrid moves its GPU share
    # itself, so a whole layer is never staged on the GPU); the torch reference runs them where the model runs.
    if engine_config.expert_backend == "native" or uses_hybrid(engine_config):
        return torch.device("cpu"), dtype
    return torch.device(engine_config.device), dtype


def build_model(cls: type[MoECausalLM], config: ModelConfig, experts: ExpertBackend, dtype: torch.dtype,
                device: str | torch.device, tensor_parallel: TensorParallel | None = None) -> MoECausalLM:
    """The module tree with uninitialized parameters on device (filled by load_weights); with tensor_parallel, this
    rank's shard of it."""
    with torch.device("meta"):
        model = cls(config, experts)
        if tensor_parallel is not None:
            shard_model(model, tensor_parallel)
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()
    model.requires_grad_(False)
    return model.eval()


def load_model(model_dir: str | Path, engine_config: EngineConfig | None = None,
               tensor_parallel: TensorParallel | None = None) -> LoadedModel:
    """model_dir: a Hugging Face model directory (bf16/fp8/GPTQ/AWQ), a converted one, or a .gguf file.
    tensor_parallel: this rank's place in a group that joined (distributed/launcher.py checked the options)."""
    engine_config = engine_config or EngineConfig()
    model_dir = resolve_model_path(model_dir, engine_config)
    cls, config = load_config(model_dir)
    if engine_config.mtp:  # the config marked before anything sizes or builds the model from it
        enable_mtp(cls, config, engine_config.deferred_experts)
    check_max_model_len(config, engine_config)  # a max_model_len the model cannot take fails before the weights load
    dtype = resolve_dtype(engine_config.dtype, config)
    check_weights_fit(model_dir, cls, config, dtype, engine_config.device)
    with open_checkpoint(model_dir, config) as ckpt:
        _check_layer_count(model_dir, ckpt, config)
        engine_config = resolve_engine_config(engine_config, config, dtype, model_dir)
        if tensor_parallel is not None:
            engine_config = rank_engine_config(engine_config)
        experts = None  # a tensor-parallel rank above 0 holds no routed expert
        if tensor_parallel is None or tensor_parallel.owns_routed_experts:
            experts = make_expert_backend(engine_config, config, cls, dtype)
        model = build_model(cls, config, _rank_experts(experts, tensor_parallel), dtype, engine_config.device,
                            tensor_parallel)
        lora = plan_lora(model, engine_config.lora) if engine_config.lora else None  # its checks before the read
        expert_device, expert_dtype = _expert_placement(engine_config, dtype)
        packed = PackedExperts(False)  # a tensor-parallel rank above 0 reads no routed expert
        if experts is not None:
            packed = _plan_packed(model_dir, engine_config, model, experts)  # a converted directory's own checks first
        if engine_config.expert_backend == "native" and packed.reads_checkpoint:
            _check_before_packing(engine_config, model, experts)
        load_weights(model, ckpt if tensor_parallel is None else RankCheckpoint(ckpt, model), expert_device,
                     expert_dtype, load_experts=packed.reads_checkpoint)
        if lora is not None:
            lora.merge()
    packed.finish(experts)
    engine_config = attach_prefill_streamer(experts, engine_config)  # the token count it measured, if any
    return LoadedModel(model=model, config=config, experts=model.experts, dtype=dtype, engine_config=engine_config)


def _rank_experts(experts: ExpertBackend | None, tensor_parallel: TensorParallel | None) -> ExpertBackend:
    """The backend a rank's model calls: experts itself in one process; under tensor parallelism rank 0's broadcasts
    their output (experts holds them), the other ranks' receive it (experts None)."""
    if tensor_parallel is None:
        return experts
    return ReceivedExperts(tensor_parallel) if experts is None else RankZeroExperts(experts, tensor_parallel)


_LAYER = re.compile(r"(?:language_model\.)?model\.(?:language_model\.)?layers\.(\d+)\.")
"""A decoder layer's tensor, in a text model's layout or a multimodal checkpoint's (Qwen3.5's model.language_model,
Kimi-K2.5's language_model.model)."""


def _check_layer_count(model_dir: Path, ckpt, config: ModelConfig) -> None:
    """A num_hidden_layers past the checkpoint's last layer fails here, before the build's per-layer work."""
    last = max((int(m.group(1)) for names in ckpt.names_by_file().values() for n in names
                if (m := _LAYER.match(n))), default=-1)
    if last < config.num_hidden_layers - 1:
        held = f"ends at model.layers.{last}" if last >= 0 else "holds no model.layers tensors"
        raise CheckpointError(f"{model_dir / 'config.json'} has num_hidden_layers {config.num_hidden_layers}, but "
                              f"the checkpoint {held}")


def _check_before_packing(engine_config: EngineConfig, model: MoECausalLM, experts: ExpertBackend) -> None:
    """What would fail only after a long read: int4 groups that do not fit the experts, too little memory."""
    E, inter = model.expert_dims()
    hidden = model.config.hidden_size
    if engine_config.expert_format == "int4":
        check_int4_group(engine_config.expert_group_size, hidden, inter,
                         "set expert_group_size to {g} (--expert-group-size {g})",
                         "set expert_format to int8 (--expert-format int8)")
    on_gpu = experts.plan.on_gpu if uses_hybrid(engine_config) else (lambda layer: ())
    check_expert_memory(engine_config, [E - len(on_gpu(layer)) for layer in model.moe_layers], hidden, inter)


def _plan_packed(model_dir: Path, engine_config: EngineConfig, model: MoECausalLM, experts: ExpertBackend):
    if not uses_hybrid(engine_config):
        return plan_packed_experts(model_dir, engine_config, model, experts)
    # The hybrid packs only each layer's CPU share, which neither a converted directory nor the cache holds.
    if read_manifest(model_dir) is not None:
        raise HybridMoEError(f"{model_dir} holds experts packed for the CPU only; GPU experts and deferral need "
                             "the original checkpoint directory")
    return PackedExperts(True)
