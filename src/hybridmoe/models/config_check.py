"""config.json checked against its family's schema before anything is derived from it or allocated.

Every key a family reads has a rule: its type (an integer is a JSON integer, never a bool, a string or a float;
a number is finite), its range, and whether null is allowed. Then the relations between keys: the experts per
token within the routed experts, the KV heads dividing the attention heads, a head_dim derived only from a
hidden_size the heads divide, layer lists within num_hidden_layers, what each rope_type needs. A value outside
its rule is one CheckpointError line naming the file, the key, the value and what is allowed.

Sizes have no upper bound here except the layer count (building the config and the module tree takes Python
work per layer): whether the weights fit is checked against the machine by the loader (system/model_memory.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import hybridmoe.layers.yarn  # noqa: F401  (registers rope_type "yarn" in ROPE_INIT)
from hybridmoe.errors import CheckpointError
from hybridmoe.layers.deepseek_routing import TOPK_METHODS
from hybridmoe.layers.mlp import ACTIVATIONS
from hybridmoe.layers.rotary import ROPE_INIT
from hybridmoe.models.base import ModelConfig, MoECausalLM, normalize_rope

MAX_HIDDEN_LAYERS = 1_000_000
"""Far above any released model (DeepSeek-V3: 61); the bound keeps the per-layer work of a corrupt count short."""

MAX_ROPE_FACTOR = 1e6


@dataclass(frozen=True)
class Rule:
    """What one config value may be: kind int, float (any finite number), bool, str, dict or list."""

    kind: type
    low: float | None = None
    """Inclusive lower bound."""
    above: float | None = None
    """Exclusive lower bound."""
    high: float | None = None
    """Inclusive upper bound."""
    null: bool = False
    choices: tuple = ()

    def allows(self, value) -> bool:
        if value is None:
            return self.null
        if self.kind is float:
            if type(value) not in (int, float) or not _finite(value):
                return False
        elif type(value) is not self.kind:
            return False
        if self.choices:
            return value in self.choices
        return ((self.low is None or value >= self.low) and (self.above is None or value > self.above)
                and (self.high is None or value <= self.high))

    def describe(self) -> str:
        if self.choices:
            want = "one of " + ", ".join(json.dumps(c) for c in self.choices)
        else:
            want = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string",
                    dict: "an object", list: "a list"}[self.kind]
            bounds = [f">= {_num(self.low)}" if self.low is not None else None,
                      f"> {_num(self.above)}" if self.above is not None else None,
                      f"<= {_num(self.high)}" if self.high is not None else None]
            if any(bounds):
                want += " " + " and ".join(b for b in bounds if b)
        return want + (" or null" if self.null else "")


def _finite(value) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer past float's range
        return False


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else str(x)


def _int(low=1, **kw) -> Rule:
    return Rule(int, low=low, **kw)


BOOL = Rule(bool)

COMMON = {
    "vocab_size": _int(), "hidden_size": _int(), "num_hidden_layers": _int(high=MAX_HIDDEN_LAYERS),
    "num_attention_heads": _int(), "intermediate_size": _int(0), "max_position_embeddings": _int(),
    "rms_norm_eps": Rule(float, above=0), "tie_word_embeddings": BOOL,
    "hidden_act": Rule(str, choices=tuple(ACTIVATIONS)),
    "num_experts_per_tok": _int(), "rope_theta": Rule(float, above=1, null=True),
    "rope_scaling": Rule(dict, null=True), "rope_parameters": Rule(dict, null=True),
    "dtype": Rule(str, null=True), "torch_dtype": Rule(str, null=True), "quantization_config": Rule(dict, null=True),
    "hybridmoe_random_weights": Rule(bool, null=True),  # make-model's mark (checkpoint/make.py RANDOM_WEIGHTS_KEY)
}
# transformers writes sliding_window 0 for no window in some versions
_GQA = {"num_key_value_heads": _int(null=True), "head_dim": _int(2, null=True), "sliding_window": _int(0, null=True)}
_QWEN = {**_GQA, "num_experts": _int(), "moe_intermediate_size": _int(), "decoder_sparse_step": _int(),
         "norm_topk_prob": BOOL, "use_sliding_window": BOOL}
_DEEPSEEK_V2 = {
    "kv_lora_rank": _int(), "q_lora_rank": _int(null=True), "qk_nope_head_dim": _int(0), "qk_rope_head_dim": _int(2),
    "v_head_dim": _int(), "first_k_dense_replace": _int(0), "moe_layer_freq": _int(), "n_routed_experts": _int(),
    "n_shared_experts": _int(0, null=True), "moe_intermediate_size": _int(),
    "topk_method": Rule(str, choices=TOPK_METHODS["softmax"]), "n_group": _int(0, null=True),
    "topk_group": _int(0, null=True), "norm_topk_prob": BOOL, "routed_scaling_factor": Rule(float, above=0),
    "attention_bias": BOOL, "mlp_bias": BOOL,
}

_GLM4_MOE = {
    "num_key_value_heads": _GQA["num_key_value_heads"], "head_dim": _GQA["head_dim"],
    "moe_intermediate_size": _int(), "n_routed_experts": _int(), "n_shared_experts": _int(0, null=True),
    "n_group": _int(0, null=True), "topk_group": _int(0, null=True), "first_k_dense_replace": _int(0),
    "norm_topk_prob": BOOL, "routed_scaling_factor": Rule(float, above=0), "attention_bias": BOOL,
    "use_qk_norm": BOOL, "partial_rotary_factor": Rule(float, above=0, high=1, null=True),
}

# transformers' MiniMaxM2 always routes by sigmoid and normalizes q and k over all heads, and has no shared experts:
# a config.json asking otherwise is refused rather than run as something else
_MINIMAX_M2 = {
    "num_key_value_heads": _GQA["num_key_value_heads"], "head_dim": _GQA["head_dim"], "num_local_experts": _int(),
    "intermediate_size": _int(), "rotary_dim": _int(2, null=True),
    "partial_rotary_factor": Rule(float, above=0, high=1, null=True),
    "scoring_func": Rule(str, choices=("sigmoid",), null=True),
    "qk_norm_type": Rule(str, choices=("per_layer",), null=True),
    "shared_intermediate_size": Rule(int, choices=(0,), null=True),
}

_GPT_OSS = {**_GQA, "num_local_experts": _int(), "intermediate_size": _int(), "attention_bias": BOOL,
            "swiglu_alpha": Rule(float, above=0), "swiglu_limit": Rule(float, above=0)}

# transformers' Qwen3Next has no sliding window: its full-attention layers see every position
_QWEN3_NEXT = {
    "num_key_value_heads": _GQA["num_key_value_heads"], "head_dim": _GQA["head_dim"], "num_experts": _int(),
    "moe_intermediate_size": _int(), "shared_expert_intermediate_size": _int(), "decoder_sparse_step": _int(),
    "norm_topk_prob": BOOL, "attention_bias": BOOL, "partial_rotary_factor": Rule(float, above=0, high=1, null=True),
    "full_attention_interval": _int(), "linear_conv_kernel_dim": _int(), "linear_key_head_dim": _int(),
    "linear_value_head_dim": _int(), "linear_num_key_heads": _int(), "linear_num_value_heads": _int(),
}

# transformers' Qwen3.5-MoE: every layer sparse, routing always renormalized (models/qwen3_5_moe.py ALWAYS_SPARSE)
_QWEN3_5_MOE = {k: v for k, v in _QWEN3_NEXT.items() if k not in ("decoder_sparse_step", "norm_topk_prob")}


@dataclass(frozen=True)
class Schema:
    rules: dict[str, Rule]
    experts_key: str
    """The key holding the routed experts per MoE layer (num_experts_per_tok must not exceed it)."""
    gqa: bool
    """Grouped-query attention: num_key_value_heads divides num_attention_heads; head_dim even."""
    layer_lists: tuple[str, ...] = ()
    """Keys holding lists of layer indices."""
    layer_types: bool = False
    """Reads layer_types: one attention kind per layer."""
    layer_kinds: tuple[str, ...] = ("full_attention", "sliding_attention")
    """The kinds layer_types may name."""


SCHEMAS = {
    "Qwen2MoeForCausalLM": Schema({**_QWEN, "shared_expert_intermediate_size": _int(0), "qkv_bias": BOOL,
                                   "max_window_layers": _int(0)}, "num_experts", True, ("mlp_only_layers",), True),
    "Qwen3MoeForCausalLM": Schema({**_QWEN, "attention_bias": BOOL}, "num_experts", True, ("mlp_only_layers",)),
    "MixtralForCausalLM": Schema({**_GQA, "num_local_experts": _int(), "intermediate_size": _int()},
                                 "num_local_experts", True),
    "DeepseekV2ForCausalLM": Schema(_DEEPSEEK_V2, "n_routed_experts", False),
    # V3 routes by noaux_tc whatever topk_method says (as transformers does)
    "DeepseekV3ForCausalLM": Schema({**_DEEPSEEK_V2, "topk_method": Rule(str, null=True), "rope_interleave": BOOL},
                                    "n_routed_experts", False),
    # V3.2: V3's keys, a q latent the indexer reads, and the indexer's shape
    "DeepseekV32ForCausalLM": Schema({**_DEEPSEEK_V2, "topk_method": Rule(str, null=True), "q_lora_rank": _int(),
                                      "index_topk": _int(), "index_head_dim": _int(2), "index_n_heads": _int(),
                                      "mlp_layer_types": Rule(list, null=True)}, "n_routed_experts", False),
    "Glm4MoeForCausalLM": Schema(_GLM4_MOE, "n_routed_experts", True),
    "GptOssForCausalLM": Schema(_GPT_OSS, "num_local_experts", True, layer_types=True),
    "MiniMaxM2ForCausalLM": Schema(_MINIMAX_M2, "num_local_experts", True),
    "Qwen3NextForCausalLM": Schema(_QWEN3_NEXT, "num_experts", True, ("mlp_only_layers",), True,
                                   ("linear_attention", "full_attention")),
    "Qwen3_5MoeForCausalLM": Schema(_QWEN3_5_MOE, "num_experts", True, (), True, ("linear_attention", "full_attention")),
}

ROPE_RULES = {
    "rope_type": Rule(str, choices=tuple(sorted(ROPE_INIT))), "rope_theta": Rule(float, above=1),
    "factor": Rule(float, above=0, high=MAX_ROPE_FACTOR, null=True),
    "original_max_position_embeddings": _int(null=True), "beta_fast": Rule(float, above=0, null=True),
    "beta_slow": Rule(float, above=0, null=True), "mscale": Rule(float, low=0, null=True),
    "mscale_all_dim": Rule(float, low=0, null=True), "attention_factor": Rule(float, above=0, null=True),
    "truncate": Rule(bool, null=True), "partial_rotary_factor": Rule(float, above=0, high=1, null=True),
}

QUANTIZATION_RULES = {
    "quant_method": Rule(str, null=True), "bits": _int(1, high=8), "group_size": _int(-1),
    "version": Rule(str), "zero_point": BOOL, "checkpoint_format": Rule(str),
    "weight_block_size": Rule(list, null=True),
}
"""quantization_config's keys the readers use; a key left out takes the reader's default."""


def schema_of(cls: type[MoECausalLM]) -> Schema:
    for klass in cls.__mro__:
        if klass.__name__ in SCHEMAS:
            return SCHEMAS[klass.__name__]
    raise KeyError(f"no config schema for {cls.__name__}")


def checked_config(cls: type[MoECausalLM], raw: dict, source: str) -> ModelConfig:
    """cls.make_config(raw), with every value it reads checked first and the derived config after."""
    values = cls.config_values(raw)
    schema = schema_of(cls)
    check = _Checker(source)
    for key, rule in {**COMMON, **schema.rules}.items():
        check.value(key, values, rule)
    check.eos_token_id(values.get("eos_token_id"))
    check.quantization(values.get("quantization_config"), cls)
    layers = values["num_hidden_layers"]
    for key in schema.layer_lists:
        check.layer_list(key, values.get(key), layers)
    if schema.layer_types:
        check.layer_types(values.get("layer_types"), layers, schema.layer_kinds)
    rope_key = "rope_parameters" if values.get("rope_parameters") else "rope_scaling"
    check.rope(rope_key, normalize_rope(values, cls.default_rope_theta), complete=False)
    check.relations(values, schema)
    config = cls.make_config(raw)
    check.rope(rope_key, config.rope_parameters, complete=True)
    return config


class _Checker:
    def __init__(self, source: str):
        self.source = source

    def fail(self, key: str, value, want: str) -> CheckpointError:
        shown = json.dumps(value, default=repr)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        return CheckpointError(f"{self.source}: {key} must be {want}, got {shown}")

    def value(self, key: str, values: dict, rule: Rule, prefix: str = "") -> None:
        if key not in values:
            if rule.null:
                return
            raise CheckpointError(f"{self.source} has no {prefix}{key}; it must be {rule.describe()}")
        if not rule.allows(values[key]):
            raise self.fail(prefix + key, values[key], rule.describe())

    def eos_token_id(self, v) -> None:
        ids = v if isinstance(v, list) else [v]
        if v is not None and not all(type(t) is int and t >= 0 for t in ids):
            raise self.fail("eos_token_id", v, "an integer >= 0, a list of them, or null")

    def quantization(self, qc: dict | None, cls: type[MoECausalLM]) -> None:
        if not qc:
            return
        if qc.get("quant_method") == "mxfp4" and not cls.mxfp4_experts:
            raise CheckpointError(f"{self.source}: quantization_config quant_method 'mxfp4' is read for gpt-oss's "
                                  f"fused experts only (GptOssForCausalLM), not for {cls.__name__}")
        for key, rule in QUANTIZATION_RULES.items():
            if key in qc:
                self.value(key, qc, rule, "quantization_config.")
        if qc.get("group_size") == 0:
            raise self.fail("quantization_config.group_size", 0, "-1 (one group per column) or an integer >= 1")
        block = qc.get("weight_block_size")
        if block is not None and (len(block) != 2 or not all(type(b) is int and b >= 1 for b in block)):
            raise self.fail("quantization_config.weight_block_size", block, "two integers >= 1")

    def layer_list(self, key: str, layers_given, num_layers: int) -> None:
        if layers_given is None:
            return
        want = f"a list of layer indices from 0 to {num_layers - 1} (num_hidden_layers {num_layers}) or null"
        if type(layers_given) is not list or not all(type(i) is int and 0 <= i < num_layers for i in layers_given):
            raise self.fail(key, layers_given, want)

    def layer_types(self, types, num_layers: int, kinds: tuple[str, ...]) -> None:
        if types is not None and (type(types) is not list or len(types) != num_layers
                                  or not all(isinstance(t, str) and t in kinds for t in types)):
            raise self.fail("layer_types", types, f"a list of {num_layers} (num_hidden_layers) entries "
                                                  f"{' or '.join(kinds)}, or null")

    def rope(self, key: str, rope: dict, complete: bool) -> None:
        """complete: the rope dict as the model reads it, where linear and yarn need their factor (and yarn its
        original context) filled in."""
        for name, rule in ROPE_RULES.items():
            if name in rope:
                self.value(name, rope, rule, f"{key}.")
        if not complete:
            return
        needs = {"linear": ("factor",), "yarn": ("factor", "original_max_position_embeddings")}
        for name in needs.get(rope["rope_type"], ()):
            if rope.get(name) is None:
                raise CheckpointError(f"{self.source}: rope_type {rope['rope_type']!r} needs {key}.{name}")

    def relations(self, values: dict, schema: Schema) -> None:
        experts, top_k = values[schema.experts_key], values["num_experts_per_tok"]
        if top_k > experts:
            raise self.fail("num_experts_per_tok", top_k, f"at most {schema.experts_key} ({experts})")
        if not schema.gqa:
            if values["qk_rope_head_dim"] % 2:
                raise self.fail("qk_rope_head_dim", values["qk_rope_head_dim"], "even (rotary rotates pairs)")
            return
        heads, hidden = values["num_attention_heads"], values["hidden_size"]
        kv_heads = values.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise self.fail("num_key_value_heads", kv_heads, f"a divisor of num_attention_heads ({heads})")
        head_dim = values.get("head_dim")
        if head_dim is None:
            if hidden % heads or hidden // heads < 2:
                raise CheckpointError(f"{self.source}: hidden_size {hidden} must be a multiple of "
                                      f"num_attention_heads {heads} (at least 2 each) when config.json gives no "
                                      "head_dim")
            head_dim = hidden // heads
        if head_dim % 2:
            raise self.fail("head_dim", head_dim, "even (rotary rotates pairs)")
