"""DeepseekV2/V3ForCausalLM loaded by load_model compute transformers' logits and hidden states.

Each case is a tiny random model of transformers' own class, saved and loaded back by us;
both sides run float32.
"""

import pytest
from compare import assert_forward_equals_transformers, save_and_load
from deepseek_tiny import tiny_deepseek

PROMPT = [5, 17, 3, 60, 22, 9, 41, 88, 0, 71, 30, 2, 64]

CASES = {
    # V2-Lite's shape of routing: no q compression, plain softmax top-k, no YaRN
    "v2-no-q-lora-greedy": ("v2", dict(q_lora_rank=None, topk_method="greedy", rope_parameters=None)),
    # V2 / V2.5: q compression, softmax within the best groups, a large routed_scaling_factor
    "v2-group-limited-greedy-yarn": ("v2", dict(q_lora_rank=32, topk_method="group_limited_greedy", n_group=4,
                                                topk_group=2, routed_scaling_factor=16.0)),
    # transformers' V2 router ignores norm_topk_prob (DeepSeek's code would renormalise and not scale)
    "v2-norm-topk-prob-ignored": ("v2", dict(q_lora_rank=None, norm_topk_prob=True, routed_scaling_factor=2.0)),
    # V3 / R1: sigmoid + correction bias within the best groups, renormalised then scaled
    "v3-noaux-tc-norm-topk-yarn": ("v3", dict(q_lora_rank=32, n_group=4, topk_group=2, norm_topk_prob=True,
                                              routed_scaling_factor=2.5, first_k_dense_replace=2,
                                              num_hidden_layers=4)),
    # Kimi-K2's shape of routing: one group, no renormalisation; here also neox rotary layout
    "v3-one-group-no-norm-no-interleave": ("v3", dict(q_lora_rank=None, n_group=1, topk_group=1,
                                                      norm_topk_prob=False, routed_scaling_factor=2.827,
                                                      rope_interleave=False)),
}


@pytest.mark.parametrize("case", CASES)
def test_logits_and_hidden_states_equal_transformers(case, tmp_path):
    family, overrides = CASES[case]
    hf = tiny_deepseek(family, **overrides)
    ours = save_and_load(hf, tmp_path, dtype="float32").model
    assert_forward_equals_transformers(ours, hf, PROMPT)


def test_dense_and_moe_layers_follow_first_k_dense_replace(tmp_path):
    loaded = save_and_load(tiny_deepseek("v3", first_k_dense_replace=2, num_hidden_layers=4), tmp_path)
    assert loaded.model.moe_layers == [2, 3]
    assert loaded.experts.layers() == [2, 3]
    names = {n for n, _ in loaded.model.named_parameters()}
    assert "model.layers.1.mlp.gate_up_proj.weight" in names
    assert "model.layers.2.mlp.shared_experts.gate_up_proj.weight" in names
    assert not any(".experts." in n for n in names)
