"""GLM-4.5 / 4.6 equals transformers' Glm4MoeForCausalLM in float32: logits, hidden states, cached greedy decode.

Each case is a tiny random model of transformers' own class (weights redrawn at O(1) scale with a nonzero
e_score_correction_bias, deepseek_tiny.randomize), saved and loaded back by us; one more is make-model's tiny
preset, which both sides load from the same directory.
"""

import json

import pytest
import torch
from compare import (
    assert_batched_decode_equals_recomputation,
    assert_forward_equals_transformers,
    save_and_load,
)
from deepseek_tiny import randomize
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM

from hybridmoe.checkpoint.make import make_checkpoint
from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model

PROMPT = [5, 17, 3, 60, 22, 9, 41, 88, 0, 71, 30, 2, 64]
PROMPTS = [[5, 17, 3, 60, 22, 9, 41], [7, 2, 33], [11, 50, 8, 19, 27]]


def rope(partial: float) -> dict:
    return {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial}


TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=3, n_group=1, topk_group=1, first_k_dense_replace=1, norm_topk_prob=True,
            routed_scaling_factor=1.0, attention_bias=True, use_qk_norm=False, max_position_embeddings=64,
            rope_parameters=rope(0.5))


def tiny_glm(**overrides) -> Glm4MoeForCausalLM:
    """A random float32 transformers Glm4MoeForCausalLM (eval mode) of the TINY shape."""
    torch.manual_seed(0)
    hf = Glm4MoeForCausalLM(Glm4MoeConfig(**{**TINY, **overrides})).float().eval()
    randomize(hf)
    return hf


CASES = {
    # GLM-4.5-Air's shape: one group, q/k/v bias, no q/k norm, half of each head rotates, one dense layer
    "air-one-group-bias-half-rotary": {},
    # GLM-4.5's shape: q/k norm; here also the best 2 of 4 groups, two shared experts, a routed scale
    "groups-qk-norm-two-shared-scaled": dict(n_group=4, topk_group=2, use_qk_norm=True, n_shared_experts=2,
                                             routed_scaling_factor=2.5),
    "no-renormalisation-full-rotary-no-bias": dict(norm_topk_prob=False, rope_parameters=rope(1.0),
                                                   attention_bias=False, routed_scaling_factor=1.8),
    "quarter-rotary-no-dense-layer": dict(rope_parameters=rope(0.25), first_k_dense_replace=0, use_qk_norm=True),
    "two-dense-layers-gqa-4-to-1": dict(first_k_dense_replace=2, num_hidden_layers=4, num_key_value_heads=1,
                                        n_group=2, topk_group=1),
}


@pytest.mark.parametrize("case", CASES)
def test_logits_and_hidden_states_equal_transformers(case, tmp_path):
    hf = tiny_glm(**CASES[case])
    ours = save_and_load(hf, tmp_path, dtype="float32").model
    assert_forward_equals_transformers(ours, hf, PROMPT)


def test_correction_bias_changes_the_chosen_experts_as_in_transformers(tmp_path):
    """A large bias on two experts makes every token choose them; both sides agree."""
    hf = tiny_glm(n_group=4, topk_group=2)
    with torch.no_grad():
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias[[1, 6]] = 5.0
    loaded = save_and_load(hf, tmp_path, dtype="float32")
    ids, _ = loaded.model.model.layers[1].mlp.gate(torch.randn(5, TINY["hidden_size"]))
    assert all({1, 6} <= set(row.tolist()) for row in ids)
    assert_forward_equals_transformers(loaded.model, hf, PROMPT)


def test_dense_and_moe_layers_follow_first_k_dense_replace(tmp_path):
    loaded = save_and_load(tiny_glm(first_k_dense_replace=2, num_hidden_layers=4), tmp_path)
    assert loaded.model.moe_layers == [2, 3]
    assert loaded.experts.layers() == [2, 3]
    names = {n for n, _ in loaded.model.named_parameters()}
    assert "model.layers.1.mlp.gate_up_proj.weight" in names
    assert "model.layers.2.mlp.shared_experts.gate_up_proj.weight" in names
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in names
    assert "model.layers.0.self_attn.qkv_proj.bias" in names and "model.layers.0.self_attn.o_proj.bias" not in names
    assert not any(".experts." in n for n in names)


def test_batched_prefill_then_greedy_decode_equals_full_recomputation(tmp_path):
    hf = tiny_glm(n_group=4, topk_group=2, use_qk_norm=True)
    ours = save_and_load(hf, tmp_path, dtype="float32").model
    assert_batched_decode_equals_recomputation(ours, hf, PROMPTS, slots=[2, 0, 3])


def test_old_config_json_with_top_level_partial_rotary_factor(tmp_path):
    """GLM-4.5's own config.json spelling: rope_theta and partial_rotary_factor at the top level."""
    raw = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", **TINY, "rope_theta": 50000.0,
           "partial_rotary_factor": 0.25, "rope_scaling": None}
    del raw["rope_parameters"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path)).float().eval()
    randomize(hf)
    loaded = save_and_load(hf, tmp_path / "saved", dtype="float32")
    attn = loaded.model.model.layers[0].self_attn
    assert attn.rotary.dim == 8 and float(attn.rotary.inv_freq(torch.device("cpu"))[1]) == pytest.approx(50000 ** -0.25)
    assert_forward_equals_transformers(loaded.model, hf, PROMPT)


def test_the_multi_token_prediction_layer_is_skipped(tmp_path):
    """Real checkpoints carry layer num_hidden_layers (the MTP module); loading ignores it."""
    hf = tiny_glm()
    hf.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    n = TINY["num_hidden_layers"]
    weights[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(TINY["hidden_size"], 2 * TINY["hidden_size"])
    weights[f"model.layers.{n}.mlp.experts.0.gate_proj.weight"] = torch.zeros(32, TINY["hidden_size"])
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ours = load_model(tmp_path, EngineConfig(dtype="float32")).model
    assert_forward_equals_transformers(ours, hf, PROMPT)


def test_the_make_model_tiny_checkpoint_equals_transformers(tmp_path):
    """make-model's glm4_moe tiny (GLM-4.5's config.json spelling, q/k norm, the best 2 of 4 groups) in both."""
    make_checkpoint("glm4_moe", "tiny", tmp_path, dtype="fp32", progress=False)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = load_model(tmp_path, EngineConfig(dtype="float32")).model
    attn = ours.model.layers[0].self_attn
    assert attn.rotary.dim == attn.head_dim // 2 and hasattr(attn, "q_norm")
    assert ours.moe_layers == [1, 2]
    assert_forward_equals_transformers(ours, hf, PROMPT)
    assert_batched_decode_equals_recomputation(ours, hf, PROMPTS, slots=[1, 0, 2])
