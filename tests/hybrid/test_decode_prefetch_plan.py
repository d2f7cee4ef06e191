"""Which weights a Qwen MoE model asks its hybrid experts to prefetch into the GPU's L2 while a layer's CPU
experts run (HybridExperts.prefetch_during): the next layer's attention projections and router."""

import pytest
import torch

from hybridmoe.checkpoint.presets import model_config
from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.hybrid import HybridExperts, TorchCpuLayer
from hybridmoe.experts.placement import Footprint, PlacementPlan
from hybridmoe.models.qwen_moe import Qwen3MoeForCausalLM


def test_each_moe_layer_prefetches_the_next_layers_attention_and_router():
    config = Qwen3MoeForCausalLM.make_config(model_config("qwen3_moe", "tiny"))
    n = config.num_hidden_layers
    fp = Footprint(0, 0, 0, 0, list(range(n)), config.num_experts, config.num_experts_per_tok, config.hidden_size,
                   config.moe_intermediate_size)
    experts = HybridExperts(PlacementPlan(fp, None, "test", {}), "cpu", TorchCpuLayer, num_layers=n)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config, experts)
    layers = model.model.layers
    assert sorted(experts._prefetch) == list(range(n - 1))  # the last layer has no next one
    for i in range(n - 1):
        nxt = layers[i + 1]
        assert experts._prefetch[i] == [nxt.self_attn.qkv_proj, nxt.self_attn.o_proj, nxt.mlp.gate]
    with pytest.raises(HybridMoEError, match="one to three modules"):
        experts.prefetch_during(0, [])
