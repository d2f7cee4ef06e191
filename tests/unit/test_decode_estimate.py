"""The decode estimate's byte accounting, part by part, against the sizes a config implies; and its time model:
reads one after the other on the CPU, a layer's CPU and GPU routed experts at once with the model on a GPU."""

import pytest
import torch

from hybridmoe.checkpoint.presets import model_config
from hybridmoe.models.registry import architecture_of, get_model_class
from hybridmoe.system.decode_estimate import (
    MODEL_PARTS,
    Bandwidths,
    TokenBytes,
    estimate_decode,
    model_part,
    model_token_bytes,
)

CONTEXT = 10
F32 = 4


def _bytes(arch: str) -> tuple[dict, dict]:
    raw = model_config(arch, "tiny", dtype="fp32")
    cls = get_model_class(architecture_of(raw))
    return raw, model_token_bytes(cls, cls.make_config(raw), torch.float32, CONTEXT)


def test_qwen2_moe_parts_are_the_sizes_its_config_implies():
    c, parts = _bytes("qwen2_moe")
    H, L, D = c["hidden_size"], c["num_hidden_layers"], c["hidden_size"] // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * D, c["num_key_value_heads"] * D
    moe_layers = L - len(c["mlp_only_layers"])
    assert parts == {
        "attention": F32 * L * ((q + 2 * kv) * H + (q + 2 * kv) + q * H),  # q, k, v with biases; o
        "dense_mlp": F32 * len(c["mlp_only_layers"]) * 3 * H * c["intermediate_size"],
        "shared_experts": F32 * moe_layers * (3 * H * c["shared_expert_intermediate_size"] + H),  # + its gate
        "router": F32 * moe_layers * c["num_experts"] * H,
        "norms": F32 * (2 * L + 1) * H,
        "output_head": F32 * c["vocab_size"] * H,
        "embedding_row": F32 * H,
        "kv_cache": F32 * L * CONTEXT * 2 * kv,
    }


def test_deepseek_mla_parts_and_its_latent_cache():
    c, parts = _bytes("deepseek_v2")
    H, heads, L = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"]
    rank, rope, nope, v = c["kv_lora_rank"], c["qk_rope_head_dim"], c["qk_nope_head_dim"], c["v_head_dim"]
    dense = c["first_k_dense_replace"]
    attention = heads * (nope + rope) * H + (rank + rope) * H + rank + heads * (nope + v) * rank + H * heads * v
    assert parts["attention"] == F32 * L * attention
    assert parts["dense_mlp"] == F32 * dense * 3 * H * c["intermediate_size"]
    assert parts["shared_experts"] == F32 * (L - dense) * 3 * H * c["moe_intermediate_size"] * c["n_shared_experts"]
    assert parts["router"] == F32 * (L - dense) * c["n_routed_experts"] * H
    assert parts["kv_cache"] == F32 * L * CONTEXT * (rank + rope)  # one latent per token, not per head


@pytest.mark.parametrize("name, part", [
    ("model.layers.3.self_attn.q_a_layernorm.weight", "attention"),
    ("model.layers.3.mlp.gate.e_score_correction_bias", "router"),
    ("model.layers.3.block_sparse_moe.gate.weight", "router"),
    ("model.layers.3.mlp.gate_up_proj.weight", "dense_mlp"),
    ("model.layers.3.mlp.shared_expert_gate.weight", "shared_experts"),
    ("model.layers.3.post_attention_layernorm.weight", "norms"),
    ("model.norm.weight", "norms"),
    ("lm_head.weight", "output_head"),
])
def test_each_parameter_name_has_its_part(name, part):
    assert model_part(name) == part


def _token(with_model: float, on_host: float, model_bytes: int = 50) -> TokenBytes:
    model = dict.fromkeys(MODEL_PARTS, 0)
    model["output_head"] = model_bytes
    return TokenBytes(model, with_model, 10, on_host, 10, CONTEXT)


BW = Bandwidths(host=10.0, host_torch=5.0, gpu=100.0)


def test_on_the_cpu_every_read_follows_the_last():
    e = estimate_decode(_token(0, 2), on_gpu=False, native_host_experts=True, bw=BW)
    assert e.seconds == pytest.approx(50 / 5 + 20 / 10) and e.bound == "cpu"
    assert e.decode_tok_s == pytest.approx(1 / 12)
    torch_experts = estimate_decode(_token(2, 0), on_gpu=False, native_host_experts=False, bw=BW)
    assert torch_experts.seconds == pytest.approx(70 / 5)  # the torch reference reads its experts as torch does
    assert torch_experts.bytes_per_token()["routed_experts_cpu"] == 20


def test_on_a_gpu_the_cpu_and_gpu_experts_of_a_layer_run_at_once():
    e = estimate_decode(_token(3, 2), on_gpu=True, native_host_experts=True, bw=BW)
    assert e.seconds == pytest.approx(50 / 100 + max(30 / 100, 20 / 10))
    assert e.device_seconds() == pytest.approx({"gpu": 0.8, "cpu": 2.0}) and e.bound == "cpu"
    assert e.bytes_per_token()["routed_experts_gpu"] == 30 and e.bytes_per_token()["routed_experts_cpu"] == 20
    gpu_bound = estimate_decode(_token(3, 0.05), on_gpu=True, native_host_experts=True, bw=BW)
    assert gpu_bound.bound == "gpu" and gpu_bound.seconds == pytest.approx(0.8)
    data = e.to_json()
    assert data["decode_tok_s"] == pytest.approx(1 / 2.5) and data["bound"] == "cpu"
