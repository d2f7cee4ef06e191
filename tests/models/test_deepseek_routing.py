"""DeepSeek routing picks the same experts with the same weights as transformers' routers.

T tokens, H hidden, E experts, K experts per token. Top-k order is not part of the contract
(both sides use sorted=False), so each token's (id, weight) pairs are compared sorted by id.
"""

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from hybridmoe.errors import CheckpointError
from hybridmoe.layers.deepseek_routing import DeepseekRouter

H, E, K = 32, 16, 4


def by_expert(ids, weights):
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.gather(1, order)


def compare(hf, ours, tokens=64):
    torch.manual_seed(1)
    x = torch.randn(tokens, H)
    _, hf_weights, hf_ids = hf(x)
    ids, weights = ours(x)
    want_ids, want_weights = by_expert(hf_ids, hf_weights)
    got_ids, got_weights = by_expert(ids, weights)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_weights, want_weights, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("topk_method,n_group,topk_group", [("greedy", None, None), ("group_limited_greedy", 4, 2)])
@torch.inference_mode()
def test_softmax_routing_matches_deepseek_v2(topk_method, n_group, topk_group):
    cfg = DeepseekV2Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=K, topk_method=topk_method,
                           n_group=n_group, topk_group=topk_group, routed_scaling_factor=16.0)
    torch.manual_seed(0)
    hf = DeepseekV2TopkRouter(cfg)
    torch.nn.init.normal_(hf.weight)
    ours = DeepseekRouter(H, E, K, scoring_func="softmax", topk_method=topk_method, n_group=n_group,
                          topk_group=topk_group, routed_scaling_factor=16.0)
    ours.load_state_dict(hf.state_dict())
    compare(hf, ours)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("n_group,topk_group", [(4, 2), (1, 1)])
@torch.inference_mode()
def test_sigmoid_noaux_tc_routing_with_correction_bias_matches_deepseek_v3(norm_topk_prob, n_group, topk_group):
    cfg = DeepseekV3Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=K, n_group=n_group,
                           topk_group=topk_group, norm_topk_prob=norm_topk_prob, routed_scaling_factor=2.5)
    torch.manual_seed(0)
    hf = DeepseekV3TopkRouter(cfg)
    torch.nn.init.normal_(hf.weight)
    # a bias as large as the scores, so choosing by biased score and weighting by unbiased score differ
    torch.nn.init.normal_(hf.e_score_correction_bias, std=0.5)
    ours = DeepseekRouter(H, E, K, scoring_func="sigmoid", topk_method="noaux_tc", n_group=n_group,
                          topk_group=topk_group, norm_topk_prob=norm_topk_prob, routed_scaling_factor=2.5)
    ours.load_state_dict(hf.state_dict())
    compare(hf, ours)


def test_router_stays_float32_when_the_model_is_cast_to_bfloat16():
    ours = DeepseekRouter(H, E, K, scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2)
    ours.to(torch.bfloat16)
    assert ours.weight.dtype == ours.e_score_correction_bias.dtype == torch.float32


def test_group_limit_is_respected():
    ours = DeepseekRouter(H, E, K, scoring_func="softmax", topk_method="group_limited_greedy", n_group=4,
                          topk_group=1)
    torch.nn.init.normal_(ours.weight)
    ids, _ = ours(torch.randn(32, H))
    # with one group of E / 4 = 4 experts allowed, all K = 4 ids of a token share a group
    assert torch.equal((ids // 4).min(dim=-1).values, (ids // 4).max(dim=-1).values)


@pytest.mark.parametrize("kwargs,message", [
    (dict(scoring_func="sigmoid", topk_method="greedy"), "unsupported DeepSeek routing"),
    (dict(scoring_func="softmax", topk_method="group_limited_greedy", n_group=3, topk_group=1), "must divide"),
    (dict(scoring_func="sigmoid", topk_method="noaux_tc", n_group=8, topk_group=1), "exceeds"),
])
def test_impossible_routing_configs_are_checkpoint_errors(kwargs, message):
    with pytest.raises(CheckpointError, match=message):
        DeepseekRouter(H, E, K, **kwargs)
