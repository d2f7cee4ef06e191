"""config.json values outside their family's schema: one CheckpointError line naming the key, the value and what
is allowed, before anything is derived or built."""

import json

import pytest

from hybridmoe.checkpoint.presets import PRESETS, model_config
from hybridmoe.errors import CheckpointError
from hybridmoe.models.config_check import checked_config
from hybridmoe.models.registry import get_model_class, load_config


def config_error(tmp_path, family: str, **changes) -> str:
    config = {**model_config(family, "tiny", dtype="fp32"), **changes}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as e:
        load_config(tmp_path)
    message = str(e.value)
    assert "\n" not in message and str(tmp_path / "config.json") in message
    return message


@pytest.mark.parametrize("family, key, value, want", [
    ("qwen3_moe", "hidden_size", "64", 'hidden_size must be an integer >= 1, got "64"'),
    ("qwen3_moe", "hidden_size", 64.0, "hidden_size must be an integer >= 1, got 64.0"),
    ("qwen3_moe", "hidden_size", True, "hidden_size must be an integer >= 1, got true"),
    ("qwen3_moe", "vocab_size", 0, "vocab_size must be an integer >= 1, got 0"),
    ("qwen3_moe", "num_hidden_layers", 10**6 + 1, "num_hidden_layers must be an integer >= 1 and <= 1000000"),
    ("qwen3_moe", "rms_norm_eps", float("nan"), "rms_norm_eps must be a finite number > 0, got NaN"),
    ("qwen3_moe", "rms_norm_eps", 0, "rms_norm_eps must be a finite number > 0, got 0"),
    ("qwen3_moe", "tie_word_embeddings", "false", 'tie_word_embeddings must be true or false, got "false"'),
    ("qwen3_moe", "hidden_act", ["silu"], 'hidden_act must be one of "silu", "swish", "gelu", "relu", got ["silu"]'),
    ("qwen3_moe", "torch_dtype", 16, "torch_dtype must be a string or null, got 16"),
    ("qwen3_moe", "rope_theta", 1, "rope_theta must be a finite number > 1 or null, got 1"),
    ("qwen3_moe", "rope_scaling", "yarn", 'rope_scaling must be an object or null, got "yarn"'),
    ("qwen3_moe", "rope_scaling", {"type": "yarn", "factor": "4"}, 'rope_scaling.factor must be a finite number'),
    ("qwen3_moe", "rope_scaling", {"type": "dynamic", "factor": 2.0},
     'rope_scaling.rope_type must be one of "default", "linear", "yarn", got "dynamic"'),
    ("qwen3_moe", "rope_scaling", {"type": "linear"}, "rope_type 'linear' needs rope_scaling.factor"),
    ("qwen3_moe", "num_key_value_heads", 3, "num_key_value_heads must be a divisor of num_attention_heads (4), got 3"),
    ("qwen3_moe", "num_experts_per_tok", 9, "num_experts_per_tok must be at most num_experts (8), got 9"),
    ("qwen3_moe", "head_dim", 15, "head_dim must be even (rotary rotates pairs), got 15"),
    ("qwen3_moe", "mlp_only_layers", [2], "mlp_only_layers must be a list of layer indices from 0 to 1"),
    ("qwen3_moe", "mlp_only_layers", "0", 'mlp_only_layers must be a list of layer indices from 0 to 1'),
    ("qwen3_moe", "eos_token_id", "2", 'eos_token_id must be an integer >= 0, a list of them, or null, got "2"'),
    ("qwen3_moe", "quantization_config", {"quant_method": "gptq", "bits": "4"},
     'quantization_config.bits must be an integer >= 1 and <= 8, got "4"'),
    ("qwen3_moe", "quantization_config", {"quant_method": "gptq", "group_size": 0}, "quantization_config.group_size"),
    ("qwen3_moe", "quantization_config", {"quant_method": "fp8", "weight_block_size": [128]},
     "quantization_config.weight_block_size must be two integers >= 1, got [128]"),
    ("qwen2_moe", "layer_types", ["full_attention"], "layer_types must be a list of 3 (num_hidden_layers) entries"),
    ("qwen2_moe", "shared_expert_intermediate_size", -1, "shared_expert_intermediate_size must be an integer >= 0"),
    ("qwen2_moe", "qkv_bias", 1, "qkv_bias must be true or false, got 1"),
    ("mixtral", "num_local_experts", 0, "num_local_experts must be an integer >= 1, got 0"),
    ("mixtral", "intermediate_size", 0, "intermediate_size must be an integer >= 1, got 0"),
    ("mixtral", "sliding_window", -1, "sliding_window must be an integer >= 0 or null, got -1"),
    ("deepseek_v2", "qk_rope_head_dim", 7, "qk_rope_head_dim must be even (rotary rotates pairs), got 7"),
    ("deepseek_v2", "topk_method", "noaux_tc", 'topk_method must be one of "greedy", "group_limited_greedy"'),
    ("deepseek_v2", "num_experts_per_tok", None, "num_experts_per_tok must be an integer >= 1, got null"),
    ("deepseek_v2", "kv_lora_rank", 1.5, "kv_lora_rank must be an integer >= 1, got 1.5"),
    ("deepseek_v2", "n_routed_experts", 2, "num_experts_per_tok must be at most n_routed_experts (2), got 4"),
    ("deepseek_v3", "rope_interleave", "yes", 'rope_interleave must be true or false, got "yes"'),
    ("deepseek_v3", "routed_scaling_factor", float("inf"), "routed_scaling_factor must be a finite number > 0, got "
                                                           "Infinity"),
    ("glm4_moe", "partial_rotary_factor", 1.5, "partial_rotary_factor must be a finite number > 0 and <= 1"),
    ("glm4_moe", "use_qk_norm", "no", 'use_qk_norm must be true or false, got "no"'),
    ("glm4_moe", "n_routed_experts", 3, "num_experts_per_tok must be at most n_routed_experts (3), got 4"),
])
def test_a_value_outside_its_rule_is_named_with_what_is_allowed(tmp_path, family, key, value, want):
    assert want in config_error(tmp_path, family, **{key: value})


def test_a_yarn_rope_names_its_bad_field(tmp_path):
    rope = {**model_config("deepseek_v3", "tiny")["rope_scaling"], "beta_fast": 0}
    assert "rope_scaling.beta_fast must be a finite number > 0 or null, got 0" in config_error(
        tmp_path, "deepseek_v3", rope_scaling=rope)


def test_a_partial_rotary_of_fewer_than_two_dimensions_is_named(tmp_path):
    config = {**model_config("glm4_moe", "tiny"), "partial_rotary_factor": 0.0625}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"head_dim 16 \* partial_rotary_factor 0.0625 gives 1 rotary dim"):
        load_config(tmp_path)


def test_a_head_dim_derived_from_the_hidden_size_needs_heads_that_divide_it(tmp_path):
    assert "hidden_size 66 must be a multiple of num_attention_heads 4" in config_error(
        tmp_path, "mixtral", hidden_size=66)


def test_a_required_key_the_family_has_no_default_for_is_named_missing(tmp_path):
    config = model_config("deepseek_v2", "tiny")
    del config["num_experts_per_tok"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="num_experts_per_tok must be an integer >= 1, got null"):
        load_config(tmp_path)


def test_architectures_that_are_not_class_names(tmp_path):
    assert '"architectures" must be a list of class names, got [[1]]' in config_error(
        tmp_path, "qwen3_moe", architectures=[[1]])


def test_an_integer_past_json_number_limits_is_invalid_json(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": ' + "9" * 5000 + "}")
    with pytest.raises(CheckpointError, match="is not valid JSON"):
        load_config(tmp_path)


@pytest.mark.parametrize("family, preset", [(f, p) for f in PRESETS for p in PRESETS[f]])
def test_every_preset_passes_and_reads_as_make_config_reads_it(family, preset):
    raw = model_config(family, preset)
    cls = get_model_class(raw["architectures"][0])
    assert checked_config(cls, raw, "config.json").to_dict() == cls.make_config(raw).to_dict()


@pytest.mark.parametrize("changes", [
    {"rope_scaling": None, "rope_theta": 10000},
    {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
    {"num_key_value_heads": None, "head_dim": None},
    {"eos_token_id": [1, 2], "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": -1}},
])
def test_the_other_spellings_real_configs_use_pass(tmp_path, changes):
    config = {**model_config("qwen3_moe", "tiny"), **changes}
    (tmp_path / "config.json").write_text(json.dumps(config))
    _, loaded = load_config(tmp_path)
    assert loaded.num_key_value_heads >= 1 and loaded.head_dim % 2 == 0
