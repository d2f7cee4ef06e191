"""from_pretrained: a local transformers MoE checkpoint loaded as transformers' own model, its routed experts packed
into the native CPU engine as they are read, so no full float copy of the experts is ever built.

How: transformers builds the model with an empty OffloadedExperts where each MoE layer's Experts module goes
(its monkey-patching registry, transformers.monkey_patching, which from_pretrained applies while it builds the
model) and loads every other tensor of the checkpoint through its own loader (key renames, dtype, tied
embeddings, buffers), given as a state dict of lazily read safetensors slices from which the routed experts'
tensors are left out: the experts' parameters never exist, so nothing allocates or initializes them. Then each
layer's experts are read from the memory-mapped files and packed one expert at a time (checkpoint_experts.py), a
layer's pages dropped from the resident set once it is packed: memory holds the model's other weights, the packed
experts and at most one layer of the checkpoint's.

Float checkpoints (bf16, fp16, fp32) and two quantized kinds load: block FP8 (quantization_config quant_method
"fp8", 128x128 blocks: DeepSeek-V3/R1, GLM-4.5-FP8; X.weight float8_e4m3fn beside X.weight_scale_inv) and MXFP4
(quant_method "mxfp4": gpt-oss, its routed experts as X_blocks and X_scales). Their routed experts go to the
engine as codes (checkpoint_experts.py): expert_format "auto" keeps them in the engine's fp8 or mxfp4 format bit
for bit, another format converts one expert at a time. Every other block-FP8 weight (attention, dense and shared
MLPs, ...) is dequantized into the model's dtype as it is handed to transformers, and transformers sees the config
without its quantization_config: it builds and runs an ordinary unquantized model around the offloaded experts
(model.config has no quantization_config either). Any other quantization (GPTQ, AWQ, ...) is refused in one line.
The patch is global while a load builds its model: a transformers model built in another thread meanwhile would
get empty experts too, so loads through this function are serialized and no other thread should build that
family's models at the same time.
"""

from __future__ import annotations

import re
import sys
import threading
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from hybridmoe.errors import HybridMoEError
from hybridmoe.hf.checkpoint_experts import CheckpointExperts, is_expert_tensor
from hybridmoe.hf.family_layouts import Family, family_of
from hybridmoe.hf.offload import no_experts_message, packing_options, require_native_engine
from hybridmoe.hf.offloaded_experts import OffloadedExperts
from hybridmoe.weights.fp8 import FP8_DTYPES, SCALE_SUFFIX
from hybridmoe.weights.mxfp4 import BLOCKS, SCALES
from hybridmoe.weights.safetensors import SafetensorsCheckpoint

_BUILDING = threading.Lock()
"""Held while the patch that builds empty experts is registered."""

_OWN_ARGUMENTS = {"config", "state_dict", "quantization_config", "dtype"}
"""transformers' from_pretrained arguments that this function sets itself."""

NATIVE_FORMATS = {None: "bf16", "fp8": "fp8", "mxfp4": "mxfp4"}
"""quant_method -> the expert format "auto" packs (None: a float checkpoint)."""

FP8_BLOCK = [128, 128]
"""The block-FP8 weight_block_size read: the native fp8 format's blocks."""


def from_pretrained(path, torch_dtype="auto", expert_format: str = "auto", cpu_threads: int | None = None,
                    expert_group_size: int | None = None, **model_kwargs) -> torch.nn.Module:
    """The transformers causal LM in the local directory `path` (config.json and *.safetensors), with every MoE
    layer's routed experts in an OffloadedExperts that runs them in the native CPU engine.

    torch_dtype: the dtype of the model's other weights ("auto": config.json's, else the checkpoint's);
    expert_format: "auto" (the checkpoint's own: "fp8" for a block-FP8 checkpoint, "mxfp4" for an MXFP4 one, the
    experts' codes packed as they are; "bf16" for a float one) or any of offload_experts' formats, a quantized
    checkpoint's experts then converted one at a time; cpu_threads, expert_group_size: as offload_experts.
    A block-FP8 or MXFP4 checkpoint loads with its other weights dequantized into torch_dtype, and the returned
    model's config has no quantization_config: transformers runs it as an unquantized model around the offloaded
    experts. model_kwargs go to transformers' from_pretrained (e.g. attn_implementation). The experts compute on
    the CPU: where the model's other weights sit on a GPU (device_map), each layer's activations cross to the CPU
    and back.
    """
    require_native_engine()
    from transformers import AutoConfig

    model_dir = Path(path)
    if not (model_dir / "config.json").is_file():
        raise HybridMoEError(f"{model_dir} is not a local model directory (it has no config.json)")
    own = sorted(_OWN_ARGUMENTS & model_kwargs.keys())
    if own:
        raise HybridMoEError(f"hybridmoe.hf.from_pretrained sets {', '.join(own)} itself; pass the dtype as "
                             "torch_dtype")
    config = AutoConfig.from_pretrained(model_dir)
    family = family_of(config, f"the model in {model_dir}")
    method = _quantization(config, model_dir)
    if expert_format == "auto":
        expert_format = NATIVE_FORMATS[method]
    options = packing_options(expert_format, cpu_threads, expert_group_size)
    with SafetensorsCheckpoint(model_dir) as ckpt:
        dtype = _resolve_dtype(torch_dtype, config, ckpt)
        experts = CheckpointExperts(ckpt, family, dtype)
        model = _load_all_but_experts(ckpt, config, family, dtype, model_kwargs)
        _load_experts(model, family, experts, options)
    _set_name_and_generation_config(model, model_dir)
    return model


def _load_all_but_experts(ckpt: SafetensorsCheckpoint, config, family: Family, dtype, model_kwargs: dict):
    """transformers' model of this config, every tensor of the checkpoint but the routed experts loaded by
    transformers, each routed-experts module an empty OffloadedExperts."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    with ExitStack() as files:
        handles = {file: files.enter_context(safe_open(ckpt.model_dir / file, framework="pt")) for file in ckpt.files}
        state_dict = {}
        for name, file in ckpt.file_of.items():
            if is_expert_tensor(name) or (name.endswith(SCALE_SUFFIX) and name[:-len(SCALE_SUFFIX)] in ckpt.file_of):
                continue  # a routed expert's, or a block-FP8 weight's scale (folded into the weight below)
            if name.endswith(BLOCKS) and name[:-len(BLOCKS)] + SCALES in ckpt.file_of:
                raise HybridMoEError(f"{ckpt.model_dir} holds the MXFP4 tensor {name} outside the routed experts; "
                                     "hybridmoe.hf.from_pretrained reads MXFP4 routed experts only")
            if ckpt.dtype(name) in FP8_DTYPES:  # get() dequantizes it block by block, in float32
                state_dict[name] = ckpt.get(name).to(dtype)
            else:
                state_dict[name] = handles[file].get_slice(name)
        with _experts_built_empty(family):
            return model_cls.from_pretrained(None, config=config, state_dict=state_dict, dtype=dtype, **model_kwargs)


def _quantization(config, model_dir: Path) -> str | None:
    """The checkpoint's quant_method, None for a float one, with quantization_config taken off the config (the model
    transformers builds is unquantized); a quantization this loader does not read is refused."""
    quantization = getattr(config, "quantization_config", None)
    if not quantization:
        return None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
    if method not in ("fp8", "mxfp4"):
        raise HybridMoEError(f"{model_dir} is quantized with {method}, which hybridmoe.hf.from_pretrained does not "
                             "read (it reads float, block-FP8 fp8 and MXFP4 mxfp4 checkpoints)")
    block = quantization.get("weight_block_size", FP8_BLOCK) if method == "fp8" else FP8_BLOCK
    if list(block) != FP8_BLOCK:
        raise HybridMoEError(f"{model_dir} is block FP8 in {block} blocks; hybridmoe.hf.from_pretrained reads "
                             f"{FP8_BLOCK} blocks (DeepSeek-V3's, the native fp8 format's)")
    del config.quantization_config
    return method


@contextmanager
def _experts_built_empty(family: Family):
    """While open, transformers builds an empty OffloadedExperts wherever a model of this family has its Experts
    module."""
    from transformers.monkey_patching import register_patch_mapping, unregister_patch_mapping

    key = f"^{family.experts_class}$"
    with _BUILDING:
        try:
            register_patch_mapping({key: OffloadedExperts})
        except ValueError as e:
            raise HybridMoEError(f"cannot register hybridmoe's patch of {family.experts_class} with transformers "
                                 f"({e})") from None
        try:
            yield
        finally:
            unregister_patch_mapping([key])


def _load_experts(model: torch.nn.Module, family: Family, experts: CheckpointExperts, options: dict) -> None:
    """Each empty OffloadedExperts of the model filled with its layer's experts from the checkpoint, in layer
    order."""
    shells = [(name, m) for name, m in model.named_modules() if isinstance(m, OffloadedExperts)]
    if not shells:
        raise HybridMoEError(no_experts_message(model, family) + " (another transformers patch mapping may "
                             f"replace {family.experts_class})")
    transformers_class = getattr(sys.modules[type(model).__module__], family.experts_class)
    for name, shell in shells:
        layer = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
        if layer is None:
            raise HybridMoEError(f"cannot tell the layer of {type(model).__name__}'s experts module {name}")
        with torch.device("meta"):
            reference = transformers_class(shell.config)
        shell.load(experts.pack(int(layer[1]), reference, options))


def _resolve_dtype(torch_dtype, config, ckpt: SafetensorsCheckpoint) -> torch.dtype:
    """torch_dtype as a torch float dtype (or its name); "auto": config.json's dtype, else the dtype of the
    checkpoint's first float tensor."""
    if torch_dtype == "auto":
        torch_dtype = getattr(config, "dtype", None)
        if torch_dtype is None:
            floats = (ckpt.dtype(name) for name in sorted(ckpt.file_of))
            torch_dtype = next((d for d in floats if d is not None and d.is_floating_point), torch.float32)
    dtype = getattr(torch, torch_dtype, None) if isinstance(torch_dtype, str) else torch_dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise HybridMoEError(f"torch_dtype must be a torch float dtype or 'auto', got {torch_dtype!r}")
    return dtype


def _set_name_and_generation_config(model: torch.nn.Module, model_dir: Path) -> None:
    """What transformers' from_pretrained takes from the directory besides the weights: its name, and
    generation_config.json where there is one."""
    from transformers import GenerationConfig

    model.name_or_path = model.config.name_or_path = str(model_dir)
    if (model_dir / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
