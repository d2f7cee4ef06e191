"""What the decode GEMV (DecoderLayer.fused_layer, CUDA only) relies on, checked on the CPU: Attention given
its qkv projection and a MoE block given its router logits compute what they compute from x; the switch
reaches every layer; short CPU steps keep the torch path. The kernel itself: tests/device/test_gemv_triton.py.

T tokens, H hidden.
"""

import torch

from hybridmoe.checkpoint.presets import model_config
from hybridmoe.experts.torch_ref import TorchExperts
from hybridmoe.forward_context import Context, use_context
from hybridmoe.layers.attention import Attention
from hybridmoe.layers.linear import decode_gemv
from hybridmoe.models.base import DecoderLayer
from hybridmoe.models.qwen_moe import Qwen3MoeForCausalLM


def tiny_model() -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    config = Qwen3MoeForCausalLM.make_config(model_config("qwen3_moe", "tiny"))
    model = Qwen3MoeForCausalLM(config, TorchExperts())
    for layer in model.model.layers:
        torch.nn.init.normal_(layer.self_attn.qkv_proj.weight, std=0.2)
    for i in model.moe_layers:
        E, I, H = config.num_experts, config.moe_intermediate_size, config.hidden_size
        model.experts.set_layer(i, torch.randn(E, I, H) / 8, torch.randn(E, I, H) / 8, torch.randn(E, H, I) / 8)
    return model


def test_attention_given_its_qkv_projection_equals_attention_of_x():
    layer = tiny_model().model.layers[0]
    attn = layer.self_attn
    x = torch.randn(3, attn.qkv_proj.in_features)
    positions = torch.arange(3)
    with use_context(Context(slot_ids=[0], start_pos=[0], cu_seqlens=[0, 3])):
        assert torch.equal(attn(None, positions, qkv=attn.qkv_proj(x)), attn(x, positions))


def test_moe_block_given_its_router_logits_equals_the_block_on_x():
    model = tiny_model()
    mlp = model.model.layers[model.moe_layers[0]].mlp
    x = torch.randn(4, model.config.hidden_size)
    assert torch.equal(mlp(x, mlp.gate(x)), mlp(x))


def test_deepseek_router_given_its_logits_equals_the_router_on_x():
    from hybridmoe.layers.deepseek_routing import DeepseekRouter

    for scoring, method in (("softmax", "greedy"), ("sigmoid", "noaux_tc")):
        router = DeepseekRouter(32, 16, 4, scoring_func=scoring, topk_method=method, n_group=4, topk_group=2)
        torch.nn.init.normal_(router.weight)
        x = torch.randn(3, 32)
        ids, weights = router(x, torch.nn.functional.linear(x.float(), router.weight))
        want_ids, want_weights = router(x)
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)


def test_fuse_decode_kernels_switches_the_layer_fusions_apart_from_the_others():
    model = tiny_model()
    gemv = [m for m in model.modules() if hasattr(m, "fused_layer")]
    assert {type(m) for m in gemv} == {DecoderLayer, Attention}  # MultiHeadLatentAttention too in DeepSeek
    assert all(m.fused_layer for m in gemv)  # on by default
    model.fuse_decode_kernels(True, layer=False)
    assert not any(m.fused_layer for m in gemv) and model.model.norm.fused
    model.fuse_decode_kernels(True)
    assert all(m.fused_layer for m in gemv) and model.model.norm.fused
    model.fuse_decode_kernels(False, layer=True)  # the layer fusions only on top of the others
    assert not any(m.fused_layer for m in gemv)


def test_cpu_steps_keep_the_torch_path():
    assert not decode_gemv(torch.randn(1, 8), True, torch.nn.Linear(8, 4))
