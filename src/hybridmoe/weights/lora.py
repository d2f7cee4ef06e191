"""A PEFT LoRA adapter merged into a loaded model's weights (EngineConfig.lora, --lora DIR).

The adapter is a directory as peft's save_pretrained writes it (the format of peft 0.22):
  - adapter_config.json: peft_type "LORA", r, lora_alpha, use_rslora, rank_pattern and alpha_pattern (a module's
    own r and alpha, keyed by a regex matched against the end of its path), lora_bias, and the options that make
    a LoRA variant or an init that changes the base weights;
  - adapter_model.safetensors: for each adapted module M (its path in the Hugging Face model),
    base_model.model.M.lora_A.weight [r, in] and base_model.model.M.lora_B.weight [out, r] (and lora_B.bias [out]
    with lora_bias); beside them, whole tensors that replace the base model's: biases trained with bias "all" or
    "lora_only" (M.base_layer.bias where M is adapted) and the modules of modules_to_save.

Each pair merges as peft's merge_and_unload does: W [out, in] += scaling * B @ A, with scaling = alpha / r, or
alpha / sqrt(r) with use_rslora; the sum is taken in float32 and cast to W's dtype. fan_in_fan_out does not change
it: A and B are stored [r, in] and [out, r] whatever the base layer's layout, and our weights are [out, in].
A module path maps to our parameter as a checkpoint name does (model.param_target): q/k/v land in their rows of
qkv_proj, gate/up in theirs of gate_up_proj, a multimodal checkpoint's text prefix is dropped.

Merged: attention projections (grouped-query, gated, MLA's q_a/q_b/kv_a/kv_b, DeepSeek-V3.2's indexer), dense
MLPs, shared experts (and their gate) and the linear-attention projections. Refused with a one-line error naming
the module: routed experts (one module per expert, or transformers 5's fused experts parameters: their weights
live packed in the expert backend), the router, the embeddings and lm_head; LoRA variants (DoRA and the rest),
inits that change the base weights (PiSSA, OLoRA, ...), and an adapter made for another base model (a module this
model lacks, another shape). Modules the model does not run (a vision tower, multi-token prediction) are skipped.

plan_lora makes every check before the checkpoint's weights load; LoraPlan.merge applies it after them.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from hybridmoe.errors import CheckpointError
from hybridmoe.layers.linear import MergedLinear
from hybridmoe.models.base import MoECausalLM

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
KEY_PREFIX = "base_model.model."
"""What peft puts before a module's path in every key of a causal LM's adapter."""

VARIANT_OPTIONS = ("use_dora", "velora_config", "alora_invocation_tokens", "monteclora_config", "use_bdlora",
                   "arrow_config", "kasa_config", "use_qalora")
"""LoraConfig options that make a LoRA variant (peft 0.22 tags all but use_qalora is_lora_variant; QALoRA pools
the input): the adapted layer is no longer W + scaling * B @ A, so there is nothing to merge."""

VARIANT_INITS = ("mica",)
"""init_lora_weights values that make a LoRA variant (LoraConfig's init_lora_weights metadata lora_variants)."""

BASE_CHANGING_INITS = ("pissa", "olora", "corda", "astra", "loftq", "lora_ga")
"""init_lora_weights values (or their prefixes) that rewrite the base weights when the adapter is made: such an
adapter is the difference to that rewritten base, not to the checkpoint's, until peft converts it on saving
(save_pretrained's path_initial_model_for_weight_conversion, which writes init_lora_weights true)."""

_ROUTED_EXPERTS = re.compile(r"(^|\.)experts(\.|$)")
"""A routed expert's module (mlp.experts.3.gate_proj) or the fused experts module (mlp.experts); shared experts
are spelled shared_expert(s)."""

_ROUTER = re.compile(r"\.(mlp|block_sparse_moe)\.(gate|router)$")
"""The MoE block's router (its dense MLP's projections are gate_proj/up_proj/down_proj)."""

_EMBEDDINGS = ("model.embed_tokens.weight", "lm_head.weight")

log = logging.getLogger("hybridmoe.weights")


@dataclass(frozen=True)
class _Pair:
    """One adapted module's factors, merged into the rows of our parameter that its weight fills."""

    module: str
    weight: torch.Tensor
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float
    bias: torch.Tensor | None = None
    """Our bias rows, where lora_B has a bias (lora_bias)."""
    lora_b_bias: torch.Tensor | None = None


@dataclass
class LoraPlan:
    """A checked adapter: what merge() adds to which parameter rows, and what it replaces."""

    path: Path
    pairs: list[_Pair] = field(default_factory=list)
    replaced: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """(our parameter rows, the adapter's tensor) for the whole tensors the adapter carries."""
    skipped: int = 0
    """Modules of the adapter that this model does not run."""

    @torch.no_grad()
    def merge(self) -> None:
        """Write the adapter into the parameters: the replaced tensors first, then each W += scaling * B @ A."""
        for target, tensor in self.replaced:
            target.copy_(tensor)
        for p in self.pairs:
            device = p.weight.device
            delta = p.scaling * (p.lora_b.to(device, torch.float32) @ p.lora_a.to(device, torch.float32))
            p.weight.copy_(p.weight.float() + delta)
            if p.lora_b_bias is not None:
                p.bias.copy_(p.bias.float() + p.scaling * p.lora_b_bias.to(device, torch.float32))
        log.info(self.line())

    def line(self) -> str:
        """The load log's line: adapter path, rank, modules merged."""
        ranks = sorted({p.lora_a.shape[0] for p in self.pairs})
        rank = "none" if not ranks else str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"
        kinds = ", ".join(sorted({p.module.rpartition(".")[2] for p in self.pairs}))
        parts = [f"rank {rank}", f"{len(self.pairs)} modules merged" + (f" ({kinds})" if kinds else "")]
        parts += [f"{len(self.replaced)} tensors replaced"] if self.replaced else []
        parts += [f"{self.skipped} modules the model does not run skipped"] if self.skipped else []
        return f"LoRA adapter {self.path}: {', '.join(parts[:2])}" + "".join(f"; {e}" for e in parts[2:])


def plan_lora(model: MoECausalLM, adapter_dir: str | Path) -> LoraPlan:
    """The adapter in adapter_dir checked against model (built, its weights not necessarily loaded yet); a
    CheckpointError naming the first module it cannot merge."""
    path = Path(adapter_dir).expanduser()
    config = _read_config(path)
    plan = LoraPlan(path)
    factors, replacements = _split_tensors(path, _read_tensors(path))
    targets = _Targets(model, path)
    for module, parts in factors.items():
        if "lora_A.weight" not in parts or "lora_B.weight" not in parts:
            raise CheckpointError(f"LoRA adapter {path}: {module} has {' and '.join(sorted(parts))} without its "
                                  f"{'lora_B' if 'lora_A.weight' in parts else 'lora_A'}; the file is incomplete")
        found = targets.find(module)
        if found is None:
            plan.skipped += 1
            continue
        plan.pairs.append(_pair(path, config, module, parts, *found))
    for name, tensor in replacements.items():
        module, _, param = name.rpartition(".")
        found = targets.find(module, param)
        if found is None:
            plan.skipped += 1
            continue
        _check_shape(path, name, "", tuple(tensor.shape), tuple(found[0].shape))
        plan.replaced.append((found[0], tensor))
    if not plan.pairs and not plan.replaced:
        raise CheckpointError(f"LoRA adapter {path} adapts no module of {type(model).__name__}")
    return plan


def _read_config(path: Path) -> dict:
    """adapter_config.json of a plain LoRA adapter; a CheckpointError for any other kind."""
    config_file = path / ADAPTER_CONFIG
    if not config_file.is_file():
        raise CheckpointError(f"LoRA adapter {path} has no {ADAPTER_CONFIG}; give the directory that peft's "
                              "save_pretrained wrote")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{config_file} is not valid JSON: {e}") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else None
        raise CheckpointError(f"{config_file} has peft_type {kind!r}; only LoRA adapters (\"LORA\") merge")
    variants = [o for o in VARIANT_OPTIONS if config.get(o)]
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower() in VARIANT_INITS:
        variants.append(f"init_lora_weights {init!r}")
    if variants:
        raise CheckpointError(f"LoRA adapter {path} is a LoRA variant ({', '.join(variants)}); only plain LoRA "
                              "merges into the weights")
    if isinstance(init, str) and init.lower().startswith(BASE_CHANGING_INITS):
        raise CheckpointError(f"LoRA adapter {path} was made with init_lora_weights {init!r}, which rewrites the "
                              "base weights; save it with peft's path_initial_model_for_weight_conversion first")
    if config.get("layer_replication"):
        raise CheckpointError(f"LoRA adapter {path} has layer_replication, which adds decoder layers; it does not "
                              "merge into this model's layers")
    if config.get("trainable_token_indices"):
        raise CheckpointError(f"LoRA adapter {path} trains embedding rows (trainable_token_indices); LoRA on the "
                              "embeddings or lm_head is not supported")
    return config


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    weights = path / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise CheckpointError(f"LoRA adapter {path} has no {ADAPTER_WEIGHTS} (peft's save_pretrained writes it; "
                              "a pickled adapter_model.bin is not read)")
    try:
        return load_file(weights)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{weights} cannot be read as safetensors: {e}") from None


def _split_tensors(path: Path, tensors: dict[str, torch.Tensor]
                   ) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """The adapter's tensors as (module path -> {"lora_A.weight": A, "lora_B.weight": B[, "lora_B.bias"]},
    tensor name in the base model -> the whole tensor that replaces it)."""
    factors: dict[str, dict[str, torch.Tensor]] = {}
    replacements: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        if not key.startswith(KEY_PREFIX):
            raise CheckpointError(f"LoRA adapter {path}: tensor {key} does not start with {KEY_PREFIX!r}, as every "
                                  "tensor of peft's adapter for a causal LM does")
        name = key.removeprefix(KEY_PREFIX)
        m = re.fullmatch(r"(.+)\.(lora_[A-Za-z_]+)(?:\.(weight|bias))?", name)
        if m is None:
            replacements[name.replace(".base_layer.", ".")] = tensor
            continue
        module, part, suffix = m.groups()
        module = module.replace(".base_layer", "")  # a parameter wrapped twice: the module is the same
        if part.startswith("lora_embedding"):
            raise CheckpointError(f"LoRA adapter {path} adapts {module}; LoRA on the embeddings or lm_head is not "
                                  "supported")
        if f"{part}.{suffix}" not in ("lora_A.weight", "lora_B.weight", "lora_B.bias"):
            raise CheckpointError(f"LoRA adapter {path}: tensor {key} is not part of plain LoRA (a LoRA variant's); "
                                  "only plain LoRA merges into the weights")
        factors.setdefault(module, {})[f"{part}.{suffix}"] = tensor
    return factors, replacements


class _Targets:
    """Where an adapted module's tensors go in the model: the rows of our parameters that its tensors fill."""

    def __init__(self, model: MoECausalLM, path: Path):
        self.model, self.path = model, path
        self.params = dict(model.named_parameters())

    def find(self, module: str, param: str = "weight") -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """(the rows of our parameter that module's `param` fills, for a weight the rows of its bias or None); None
        for a module the model does not run; a CheckpointError for one that does not merge or is not in it."""
        model, path, name = self.model, self.path, f"{module}.{param}"
        if (_ROUTED_EXPERTS.search(module) or model.expert_key(name) is not None
                or model.fused_expert_key(name) is not None):
            raise CheckpointError(f"LoRA adapter {path} adapts the routed experts ({module}); routed-expert LoRA is "
                                  "not supported at inference")
        if _ROUTER.search(module):
            raise CheckpointError(f"LoRA adapter {path} adapts the router ({module}); LoRA on the router is not "
                                  "supported")
        param_name, shard = model.param_target(name)
        if param_name in _EMBEDDINGS or module.endswith(("embed_tokens", "lm_head")):
            raise CheckpointError(f"LoRA adapter {path} adapts {module}; LoRA on the embeddings or lm_head is not "
                                  "supported")
        if model.is_ignored(name):
            return None
        rows = self._rows(param_name, shard)
        if rows is None:
            raise CheckpointError(f"LoRA adapter {path} adapts {module}, which {type(model).__name__} with this "
                                  "config.json does not have: the adapter was made for another base model")
        bias = self._rows(param_name.rpartition(".")[0] + ".bias", shard) if param == "weight" else None
        return rows, bias

    def _rows(self, param_name: str, shard: int | None) -> torch.Tensor | None:
        """The view of param_name that one checkpoint tensor fills (shard: its rows of a MergedLinear)."""
        param = self.params.get(param_name)
        if param is None or shard is None:
            return None if param is None else param.data
        owner = self.model.get_submodule(param_name.rpartition(".")[0])
        return param.data.narrow(0, *owner.shard_rows(shard)) if isinstance(owner, MergedLinear) else None


def _pair(path: Path, config: dict, module: str, parts: dict[str, torch.Tensor], weight: torch.Tensor,
          bias: torch.Tensor | None) -> _Pair:
    a, b, b_bias = parts["lora_A.weight"], parts["lora_B.weight"], parts.get("lora_B.bias")
    r, alpha = _rank_and_alpha(config, module)
    if a.dim() != 2 or a.shape[0] != r:
        raise CheckpointError(f"LoRA adapter {path}: {module}.lora_A has shape {list(a.shape)}, but the adapter's "
                              f"config gives it rank {r}")
    if weight.dim() != 2:
        raise CheckpointError(f"LoRA adapter {path} adapts {module}, whose weight has shape {list(weight.shape)}; "
                              "only linear layers merge")
    _check_shape(path, module, ".lora_A", tuple(a.shape), (r, weight.shape[1]))
    _check_shape(path, module, ".lora_B", tuple(b.shape), (weight.shape[0], r))
    if b_bias is not None:
        if bias is None:
            raise CheckpointError(f"LoRA adapter {path}: {module}.lora_B has a bias (lora_bias), but {module} has no "
                                  "bias to merge it into")
        _check_shape(path, module, ".lora_B.bias", tuple(b_bias.shape), tuple(bias.shape))
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return _Pair(module, weight, a, b, scaling, bias if b_bias is not None else None, b_bias)


def _rank_and_alpha(config: dict, module: str) -> tuple[int, float]:
    """(r, lora_alpha) of module: rank_pattern's and alpha_pattern's first key that matches the end of its path
    (peft's get_pattern_key), else the adapter's r and lora_alpha."""
    def pattern_value(patterns: dict | None, default):
        for key, value in (patterns or {}).items():
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        return default

    return (int(pattern_value(config.get("rank_pattern"), config.get("r", 8))),
            float(pattern_value(config.get("alpha_pattern"), config.get("lora_alpha", 8))))


def _check_shape(path: Path, module: str, part: str, got: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if got != expected:
        raise CheckpointError(f"LoRA adapter {path}: {module}{part} has shape {list(got)}, where this model needs "
                              f"{list(expected)}: the adapter was made for another base model")
