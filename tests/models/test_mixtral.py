"""Mixtral equals transformers' MixtralForCausalLM in float32 (block_sparse_moe, w1/w2/w3 experts)."""

import pytest
import torch
from compare import assert_close, hf_forward, run_step, save_and_load
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
    ours.allocate_kv_cache(1, 16)
    hidden = []
    (logits,) = run_step(ours, [PROMPTS[0]], slots=[0], start_pos=[0], hidden_states_out=hidden)
    ref_logits, ref_hidden = hf_forward(hf, PROMPTS[0])
    assert_close(logits, ref_logits, what="logits")
    for i in range(len(ref_hidden) - 1):  # transformers' last one is after the final norm
        assert_close(hidden[i], ref_hidden[i], what=f"hidden state {i}")


def test_batched_prefill_then_decode_equals_full_recomputation(tmp_path):
    hf = tiny_mixtral(sliding_window=6)
    ours = save_and_load(hf, tmp_path).model
    ours.allocate_kv_cache(3, 32)
    slots = [0, 1, 2]
    seqs = [list(p) for p in PROMPTS]
    logits = run_step(ours, seqs, slots, start_pos=[0, 0, 0])
    for step in range(3):
        next_tokens = [int(l[-1].argmax()) for l in logits]
        for seq, logit in zip(seqs, logits):
            assert_close(logit[-1], hf_forward(hf, seq)[0][-1], what=f"step {step}, length {len(seq)}")
        start = [len(s) for s in seqs]
        for seq, t in zip(seqs, next_tokens):
            seq.append(t)
        logits = run_step(ours, [[t] for t in next_tokens], slots, start)
