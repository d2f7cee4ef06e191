"""config.json -> model class and config, with transformers' defaults for what the file leaves out."""

import json

import pytest
import torch
from compare import assert_close, hf_forward, run_step
from transformers import AutoConfig, AutoModelForCausalLM

from hybridmoe.engine.model_loader import load_model
from hybridmoe.errors import CheckpointError
from hybridmoe.models.registry import get_model_class, load_config

# Hand-written config.json files in the older spelling real checkpoints use (rope_theta and
# rope_scaling beside it, num_experts for Qwen), leaving most fields to the defaults.
MINIMAL_CONFIGS = {
    "qwen2-old-rope-linear": {
        "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "vocab_size": 64,
        "hidden_size": 32, "intermediate_size": 40, "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
        "rope_theta": 1000.0, "rope_scaling": {"type": "linear", "factor": 2.0}},
    "qwen3-num-experts-head-dim": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 64,
        "hidden_size": 32, "intermediate_size": 40, "moe_intermediate_size": 16, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
        "num_experts_per_tok": 2, "rope_theta": 50000.0},
    "mixtral-default-rope": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 64,
        "hidden_size": 32, "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_local_experts": 4},
}


@pytest.mark.parametrize("name", sorted(MINIMAL_CONFIGS))
def test_minimal_config_json_gives_the_same_model_as_transformers(tmp_path, name):
    (tmp_path / "config.json").write_text(json.dumps(MINIMAL_CONFIGS[name]))
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path)).eval()
    hf.save_pretrained(tmp_path / "saved")
    # keep our own hand-written config.json, not transformers' rewrite of it
    (tmp_path / "saved" / "config.json").write_text(json.dumps(MINIMAL_CONFIGS[name]))
    ours = load_model(tmp_path / "saved").model
    ours.allocate_kv_cache(1, 16)
    ids = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 32]
    (logits,) = run_step(ours, [ids], slots=[0], start_pos=[0])
    assert_close(logits, hf_forward(hf, ids)[0], what=name)


def test_old_and_new_rope_spellings_read_the_same(tmp_path):
    cls = get_model_class("Qwen3MoeForCausalLM")
    base = {"hidden_size": 32, "num_attention_heads": 4}
    old = cls.make_config({**base, "rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 4.0}})
    new = cls.make_config({**base, "rope_parameters": {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0}})
    assert old.rope_parameters == new.rope_parameters == {"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0}


def test_family_defaults_fill_what_config_json_leaves_out():
    mixtral = get_model_class("MixtralForCausalLM").make_config({"hidden_size": 64, "num_attention_heads": 8})
    assert mixtral.rope_parameters["rope_theta"] == 1e6 and mixtral.rms_norm_eps == 1e-5
    assert mixtral.head_dim == 8 and mixtral.num_key_value_heads == 8
    qwen3 = get_model_class("Qwen3MoeForCausalLM").make_config({"num_local_experts": 6, "use_sliding_window": False})
    assert qwen3.num_experts == 6 and qwen3.norm_topk_prob is False and qwen3.sliding_window is None


def test_unsupported_architecture_lists_the_supported_ones():
    with pytest.raises(CheckpointError, match="Qwen2MoeForCausalLM.*Qwen3MoeForCausalLM"):
        get_model_class("GPT2LMHeadModel")


def test_config_without_architectures(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    with pytest.raises(CheckpointError, match="architectures"):
        load_config(tmp_path)


def test_config_that_is_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_config(tmp_path)
