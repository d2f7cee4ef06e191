"""A MoE block handed the residual stream (SparseMoeBlock.adds_residual, as DecoderLayer hands it in decode steps
on CUDA) returns residual + its output, rounded as the caller's add would round it: Qwen3's block (the backend
adds it) and Qwen2's (routed, then shared expert, then the residual), with the hybrid split on the CPU.

T tokens, H hidden, E experts.
"""

import pytest
import torch

from hybridmoe.checkpoint.presets import model_config
from hybridmoe.experts.hybrid import HybridExperts, TorchCpuLayer
from hybridmoe.experts.placement import Footprint, PlacementPlan
from hybridmoe.models.qwen_moe import Qwen2MoeForCausalLM, Qwen3MoeForCausalLM


@pytest.mark.parametrize("cls,arch", [(Qwen3MoeForCausalLM, "qwen3_moe"), (Qwen2MoeForCausalLM, "qwen2_moe")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_moe_block_given_the_residual_returns_it_plus_its_output(cls, arch, dtype):
    config = cls.make_config(model_config(arch, "tiny"))
    E, H = config.num_experts, config.hidden_size
    fp = Footprint(0, 0, 0, 0, [0], E, config.num_experts_per_tok, H, config.moe_intermediate_size)
    experts = HybridExperts(PlacementPlan(fp, None, "test", {0: [0, 2]}), "cpu", TorchCpuLayer, num_layers=1)
    g = torch.Generator().manual_seed(0)
    I = config.moe_intermediate_size
    experts.set_layer(0, torch.randn(E, I, H, generator=g) / 8, torch.randn(E, I, H, generator=g) / 8,
                      torch.randn(E, H, I, generator=g) / 6)
    block = cls(config, experts).model.layers[0].mlp.to(dtype)
    for p in block.parameters():
        p.data = (torch.randn(p.shape, generator=g) / 8).to(dtype)
    x, residual = (torch.randn(3, H, generator=g).to(dtype) for _ in range(2))
    logits = block.gate(x)
    want = residual + block(x, logits)
    assert not torch.equal(want, residual)
    assert torch.equal(block(x, logits, residual=residual), want)
