"""Qwen3-MoE equals transformers' Qwen3MoeForCausalLM in float32: logits, hidden states, cached decode."""

import pytest
import torch
from compare import (
    assert_batched_decode_equals_recomputation,
    assert_close,
    assert_forward_equals_transformers,
    hf_forward,
    run_step,
    save_and_load,
)
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

PROMPTS = [[5, 17, 3, 60, 22, 9, 41], [7, 2, 33], [11, 50, 8, 19, 27]]


def tiny_qwen3(**overrides) -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(**{
        "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 128, **overrides})
    return Qwen3MoeForCausalLM(config).eval()


@pytest.mark.parametrize("overrides", [
    {"norm_topk_prob": False},
    {"norm_topk_prob": True},
    {"mlp_only_layers": [1]},
    {"decoder_sparse_step": 2},
    {"tie_word_embeddings": True, "attention_bias": True},
    {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32}},
], ids=["unnormalized-topk", "normalized-topk", "mlp-only-layer", "sparse-step-2", "tied-with-bias", "yarn-rope"])
def test_logits_and_hidden_states_equal_transformers(tmp_path, overrides):
    hf = tiny_qwen3(**overrides)
    ours = save_and_load(hf, tmp_path).model
    assert_forward_equals_transformers(ours, hf, PROMPTS[0])


def test_moe_layers_follow_mlp_only_layers_and_sparse_step(tmp_path):
    ours = save_and_load(tiny_qwen3(num_hidden_layers=4, mlp_only_layers=[0], decoder_sparse_step=2), tmp_path)
    assert ours.model.moe_layers == [1, 3]
    assert ours.experts.layers() == [1, 3]


def test_batched_prefill_then_decode_equals_full_recomputation(tmp_path):
    hf = tiny_qwen3()
    ours = save_and_load(hf, tmp_path).model
    assert_batched_decode_equals_recomputation(ours, hf, PROMPTS, slots=[2, 0, 3])


def test_mixed_step_of_decode_and_prefill_chunk_equals_full_recomputation(tmp_path):
    hf = tiny_qwen3()
    ours = save_and_load(hf, tmp_path).model
    ours.allocate_kv_cache(2, 32)
    a, b = PROMPTS[0], PROMPTS[2]
    run_step(ours, [a[:-1], b[:2]], slots=[0, 1], start_pos=[0, 0])
    # sequence 0 decodes one token while sequence 1 prefills the rest of its prompt
    la, lb = run_step(ours, [a[-1:], b[2:]], slots=[0, 1], start_pos=[len(a) - 1, 2])
    assert_close(la[-1], hf_forward(hf, a)[0][-1], what="decoding sequence")
    assert_close(lb, hf_forward(hf, b)[0][2:], what="prefilling sequence")
