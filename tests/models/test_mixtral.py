"""Mixtral equals transformers' MixtralForCausalLM in float32 (block_sparse_moe, w1/w2/w3 experts)."""

import pytest
import torch
from compare import (
    assert_batched_decode_equals_recomputation,
    assert_forward_equals_transformers,
    save_and_load,
)
from transformers import MixtralConfig, MixtralForCausalLM

PROMPTS = [[5, 17, 3, 60, 22, 9, 41], [7, 2, 33], [11, 50, 8, 19, 27]]


def tiny_mixtral(**overrides) -> MixtralForCausalLM:
    torch.manual_seed(0)
    config = MixtralConfig(**{
        "vocab_size": 64, "hidden_size": 32, "intermediate_size": 24, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
        "max_position_embeddings": 128, **overrides})
    return MixtralForCausalLM(config).eval()


def test_checkpoint_uses_mixtral_expert_names(tmp_path):
    from safetensors import safe_open

    tiny_mixtral().save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in f.keys()


@pytest.mark.parametrize("overrides", [{}, {"head_dim": 16}, {"sliding_window": 3}],
                         ids=["default", "explicit-head-dim", "sliding-window"])
def test_logits_and_hidden_states_equal_transformers(tmp_path, overrides):
    hf = tiny_mixtral(**overrides)
    ours = save_and_load(hf, tmp_path).model
    assert_forward_equals_transformers(ours, hf, PROMPTS[0])


def test_batched_prefill_then_decode_equals_full_recomputation(tmp_path):
    hf = tiny_mixtral(sliding_window=6)
    ours = save_and_load(hf, tmp_path).model
    assert_batched_decode_equals_recomputation(ours, hf, PROMPTS, slots=[0, 1, 2])
