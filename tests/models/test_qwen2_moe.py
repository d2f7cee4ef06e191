"""Qwen2-MoE equals transformers' Qwen2MoeForCausalLM in float32: shared expert + sigmoid gate, qkv bias."""

import pytest
import torch
from compare import (
    assert_batched_decode_equals_recomputation,
    assert_forward_equals_transformers,
    save_and_load,
)
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

PROMPTS = [[5, 17, 3, 60, 22, 9, 41], [7, 2, 33], [11, 50, 8, 19, 27]]


def tiny_qwen2(**overrides) -> Qwen2MoeForCausalLM:
    torch.manual_seed(0)
    config = Qwen2MoeConfig(**{
        "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 24, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_experts": 8, "num_experts_per_tok": 2,
        "max_position_embeddings": 128, **overrides})
    model = Qwen2MoeForCausalLM(config).eval()
    with torch.no_grad():  # transformers initializes biases to zero; make the qkv bias count
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("overrides", [
    {},
    {"norm_topk_prob": True},
    {"mlp_only_layers": [0, 2]},
    {"decoder_sparse_step": 2, "tie_word_embeddings": True},
    {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 2},
], ids=["default", "normalized-topk", "mlp-only-layers", "sparse-step-2-tied", "sliding-window"])
def test_logits_and_hidden_states_equal_transformers(tmp_path, overrides):
    hf = tiny_qwen2(**overrides)
    ours = save_and_load(hf, tmp_path).model
    assert_forward_equals_transformers(ours, hf, PROMPTS[0])


def test_shared_expert_is_a_dense_module_of_the_model(tmp_path):
    loaded = save_and_load(tiny_qwen2(), tmp_path)
    names = {n for n, _ in loaded.model.named_parameters()}
    assert "model.layers.0.mlp.shared_expert.gate_up_proj.weight" in names
    assert "model.layers.0.mlp.shared_expert_gate.weight" in names
    assert not any(".experts." in n for n in names)


@pytest.mark.parametrize("overrides", [{}, {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 3}],
                         ids=["full-attention", "sliding-window"])
def test_batched_prefill_then_decode_equals_full_recomputation(tmp_path, overrides):
    hf = tiny_qwen2(**overrides)
    ours = save_and_load(hf, tmp_path).model
    assert_batched_decode_equals_recomputation(ours, hf, PROMPTS, slots=[1, 2, 0])
