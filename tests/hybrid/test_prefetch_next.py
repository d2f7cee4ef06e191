"""The next layer's attention and router weights handed to the hybrid split for its L2 prefetch
(ExpertBackend.prefetch_during): a Qwen model hands, for every MoE layer but the last, the next layer's qkv and
o projections and its router (a dense next layer has none); backends without a prefetch ignore the call; the hybrid split takes one to three."""

import pytest
from hybrid_helpers import load

from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.hybrid import HybridExperts


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_a_qwen_model_hands_each_moe_layer_the_next_layers_first_weights(tiny_checkpoints, family):
    model = load(tiny_checkpoints(family), expert_backend="torch", gpu_experts_per_layer=1).model
    experts, layers = model.experts, model.model.layers
    assert isinstance(experts, HybridExperts)
    nxt = {i: layers[i + 1] for i in model.moe_layers if i + 1 < len(layers)}
    want = {i: [n.self_attn.qkv_proj, n.self_attn.o_proj] + ([n.mlp.gate] if model.is_moe_layer(i + 1) else [])
            for i, n in nxt.items()}
    assert want and {i: [id(m) for m in ms] for i, ms in experts._prefetch.items()} == \
        {i: [id(m) for m in ms] for i, ms in want.items()}


def test_prefetch_during_takes_one_to_three_modules_and_other_backends_ignore_it(tiny_checkpoints):
    model = load(tiny_checkpoints("qwen3_moe"), expert_backend="torch", gpu_experts_per_layer=1).model
    qkv = model.model.layers[0].self_attn.qkv_proj
    for modules in ([], [qkv] * 4):
        with pytest.raises(HybridMoEError, match="one to three modules"):
            model.experts.prefetch_during(0, modules)
    plain = load(tiny_checkpoints("qwen3_moe"), expert_backend="torch").model.experts
    assert not isinstance(plain, HybridExperts)
    plain.prefetch_during(0, [qkv])  # the contract's default: nothing to prefetch into
