"""DeepseekV2/V3ForCausalLM loaded by load_model compute transformers' logits and hidden states.

Each case is a tiny random checkpoint that transformers writes; both sides run float32.
T tokens, V vocab.
"""

import pytest
import torch

from deepseek_checkpoint import FP32_TOL, load_ours, run_ours, write_checkpoint

CASES = {
    # V2-Lite's shape of routing: no q compression, plain softmax top-k, no YaRN
    "v2_no_q_lora_greedy": ("v2", dict(q_lora_rank=None, topk_method="greedy", rope_parameters=None)),
    # V2 / V2.5: q compression, softmax within the best groups, a large routed_scaling_factor
    "v2_group_limited_greedy_yarn": ("v2", dict(q_lora_rank=32, topk_method="group_limited_greedy", n_group=4,
                                                topk_group=2, routed_scaling_factor=16.0)),
    # V3 / R1: sigmoid + correction bias within the best groups, renormalised then scaled
    "v3_noaux_tc_norm_topk": ("v3", dict(q_lora_rank=32, n_group=4, topk_group=2, norm_topk_prob=True,
                                         routed_scaling_factor=2.5, first_k_dense_replace=2, num_hidden_layers=4)),
    # Kimi-K2's shape of routing: one group, no renormalisation; neox rotary layout
    "v3_one_group_no_norm_no_interleave": ("v3", dict(q_lora_rank=None, n_group=1, topk_group=1,
                                                      norm_topk_prob=False, routed_scaling_factor=2.827,
                                                      rope_interleave=False)),
}


@pytest.mark.parametrize("case", CASES)
@torch.inference_mode()
def test_logits_and_hidden_states_match_transformers(case, tmp_path):
    family, overrides = CASES[case]
    hf = write_checkpoint(tmp_path, family, **overrides)
    input_ids = torch.randint(0, hf.config.vocab_size, (13,), generator=torch.Generator().manual_seed(1))
    want = hf(input_ids[None], output_hidden_states=True)

    hidden_states = []
    logits = run_ours(load_ours(tmp_path), input_ids, hidden_states)

    # transformers' last hidden state is after the final norm; ours (like HF's others) are before it
    assert len(hidden_states) == len(want.hidden_states)
    for layer, (got, ref) in enumerate(zip(hidden_states[:-1], want.hidden_states[:-1])):
        torch.testing.assert_close(got, ref[0], **FP32_TOL, msg=lambda m: f"hidden state {layer}: {m}")
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, want.logits[0], **FP32_TOL)


@torch.inference_mode()
def test_dense_and_moe_layers_follow_first_k_dense_replace(tmp_path):
    write_checkpoint(tmp_path, "v3", first_k_dense_replace=2, num_hidden_layers=4)
    model = load_ours(tmp_path)
    assert model.moe_layers == [2, 3]
    assert model.experts.layers() == [2, 3]
