"""The files make-model writes: shards agree with the index, tensor names are the family's real
ones, real-shape presets have the real parameter counts, output is a function of the seed."""

import hashlib
import json

import pytest
from safetensors import safe_open

from hybridmoe.checkpoint import ARCHS, PRESETS, make_checkpoint, model_config
from hybridmoe.checkpoint.tensors import tensor_specs


def _write(tmp_path, arch, name="ckpt", **kwargs):
    out = tmp_path / name
    make_checkpoint(arch, "tiny", out, progress=False, **kwargs)
    return out


def _digest(out):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_shards_agree_with_index(tmp_path, arch):
    out = _write(tmp_path, arch)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 2 and {p.name for p in shards} == set(index["weight_map"].values())
    seen, total = {}, 0
    for path in shards:
        with safe_open(path, "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():
                t = f.get_tensor(name)
                seen[name] = path.name
                total += t.numel() * t.element_size()
    assert seen == index["weight_map"]
    assert total == index["metadata"]["total_size"]
    assert [s.name for s in tensor_specs(model_config(arch, "tiny"))] == list(index["weight_map"])


# names as the family's real checkpoints spell them (a sample per feature)
@pytest.mark.parametrize("arch, names", [
    ("qwen2_moe", ["model.layers.0.self_attn.q_proj.bias", "model.layers.0.mlp.shared_expert.gate_proj.weight",
                   "model.layers.0.mlp.shared_expert_gate.weight", "model.layers.0.mlp.experts.7.down_proj.weight",
                   "model.layers.1.mlp.gate_proj.weight"]),  # layer 1 is in mlp_only_layers
    ("qwen3_moe", ["model.layers.1.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight",
                   "model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.0.up_proj.weight"]),
    ("deepseek_v2", ["model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight",
                     "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
                     "model.layers.1.mlp.shared_experts.up_proj.weight"]),
    ("deepseek_v3", ["model.layers.1.self_attn.q_a_proj.weight", "model.layers.1.self_attn.q_a_layernorm.weight",
                     "model.layers.1.self_attn.q_b_proj.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
                     "model.layers.2.mlp.experts.15.gate_proj.weight"]),
    ("mixtral", ["model.layers.0.block_sparse_moe.gate.weight",
                 "model.layers.1.block_sparse_moe.experts.3.w1.weight",
                 "model.layers.1.block_sparse_moe.experts.3.w2.weight",
                 "model.layers.1.block_sparse_moe.experts.3.w3.weight"]),
    ("glm4_moe", ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.self_attn.q_proj.bias",
                  "model.layers.0.self_attn.k_proj.bias", "model.layers.0.self_attn.v_proj.bias",
                  "model.layers.1.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight",
                  "model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.mlp.shared_experts.up_proj.weight",
                  "model.layers.2.mlp.experts.15.down_proj.weight"]),
    ("minimax_m2", ["model.layers.0.block_sparse_moe.gate.weight",
                    "model.layers.0.block_sparse_moe.e_score_correction_bias",
                    "model.layers.2.block_sparse_moe.experts.15.w2.weight", "model.layers.1.self_attn.q_norm.weight"]),
    ("gpt_oss", ["model.layers.0.self_attn.sinks", "model.layers.0.self_attn.o_proj.bias",
                 "model.layers.0.mlp.router.bias", "model.layers.2.mlp.experts.gate_up_proj",
                 "model.layers.2.mlp.experts.gate_up_proj_bias", "model.layers.2.mlp.experts.down_proj_bias"]),
    ("qwen3_next", ["model.layers.0.linear_attn.in_proj_qkvz.weight", "model.layers.0.linear_attn.in_proj_ba.weight",
                    "model.layers.0.linear_attn.conv1d.weight", "model.layers.0.linear_attn.A_log",
                    "model.layers.0.linear_attn.dt_bias", "model.layers.0.linear_attn.norm.weight",
                    "model.layers.1.mlp.gate_proj.weight", "model.layers.3.self_attn.q_norm.weight",
                    "model.layers.3.mlp.shared_expert_gate.weight", "model.layers.3.mlp.experts.7.down_proj.weight"]),
    ("qwen3_5_moe", ["model.layers.0.linear_attn.in_proj_qkv.weight", "model.layers.0.linear_attn.in_proj_z.weight",
                     "model.layers.0.linear_attn.in_proj_b.weight", "model.layers.0.linear_attn.in_proj_a.weight",
                     "model.layers.1.mlp.experts.7.gate_proj.weight", "model.layers.3.self_attn.q_norm.weight",
                     "model.layers.3.mlp.shared_expert_gate.weight"]),
])
def test_tensor_names_follow_the_real_checkpoints(arch, names):
    have = {s.name for s in tensor_specs(model_config(arch, "tiny"))}
    assert set(names) <= have
    absent = {"qwen2_moe": "q_norm", "qwen3_moe": "shared_expert", "deepseek_v2": "q_a_proj",
              "deepseek_v3": "self_attn.q_proj", "mixtral": ".mlp.", "glm4_moe": "kv_a_proj",
              "minimax_m2": ".mlp.", "gpt_oss": ".experts.0.", "qwen3_next": "layers.0.self_attn",
              "qwen3_5_moe": "in_proj_qkvz"}[arch]
    assert not any(absent in n for n in have)
    if arch == "glm4_moe":
        assert "model.layers.0.self_attn.o_proj.bias" not in have and "model.layers.0.mlp.gate.weight" not in have
    if arch == "deepseek_v2":
        assert not any("e_score_correction_bias" in n for n in have)  # softmax routing has none


# total parameters of the public models (without DeepSeek-V3's, GLM-4.5's and Qwen3-Next's multi-token-prediction
# layers; gpt-oss's as its model card counts them, MXFP4 experts as the parameters they stand for; Qwen3.5-35B-A3B's
# text model as transformers' Qwen3_5MoeForCausalLM builds it from its config defaults, without the vision tower)
@pytest.mark.parametrize("arch, preset, billions", [
    ("qwen2_moe", "qwen1.5-moe-a2.7b", 14.32), ("qwen3_moe", "qwen3-30b-a3b", 30.53),
    ("deepseek_v2", "deepseek-v2-lite", 15.71), ("deepseek_v3", "deepseek-v3", 671.03),
    ("mixtral", "mixtral-8x7b", 46.70), ("glm4_moe", "glm-4.5-air", 106.85), ("minimax_m2", "minimax-m2", 228.69),
    ("gpt_oss", "gpt-oss-20b", 20.91), ("gpt_oss", "gpt-oss-120b", 116.83),
    ("qwen3_next", "qwen3-next-80b-a3b", 79.67), ("qwen3_5_moe", "qwen3.5-35b-a3b", 34.66),
])
def test_real_presets_have_the_real_parameter_count(arch, preset, billions):
    specs = tensor_specs(model_config(arch, preset))
    assert sum(s.numel for s in specs) / 1e9 == pytest.approx(billions, abs=0.01)


def test_every_arch_has_tiny_and_a_real_preset():
    assert all("tiny" in PRESETS[a] and len(PRESETS[a]) >= 2 for a in ARCHS)


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a = _digest(_write(tmp_path, "deepseek_v3", "a", seed=3))
    b = _digest(_write(tmp_path, "deepseek_v3", "b", seed=3))
    c = _digest(_write(tmp_path, "deepseek_v3", "c", seed=4))
    assert a == b
    shards = [n for n in a if n.endswith(".safetensors")]
    assert all(a[n] != c[n] for n in shards)
    assert all(a[n] == c[n] for n in a if n not in shards)  # config and tokenizer do not depend on the seed


def test_layers_cuts_depth_and_keeps_a_moe_layer(tmp_path):
    cfg = model_config("deepseek_v3", "deepseek-v3", layers=2)
    assert cfg["num_hidden_layers"] == 2 and cfg["first_k_dense_replace"] == 1
    assert model_config("deepseek_v3", "deepseek-v3", layers=5)["first_k_dense_replace"] == 3
    assert model_config("qwen2_moe", "tiny", layers=1)["mlp_only_layers"] == []
    out = _write(tmp_path, "qwen3_moe", layers=1, seed=5)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert not any(n.startswith("model.layers.1.") for n in index["weight_map"])
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1
    # a tensor's values depend on the seed and its name only: layer 0 is the same in the deeper model
    full = _write(tmp_path, "qwen3_moe", "full", seed=5)
    name = "model.layers.0.mlp.experts.3.down_proj.weight"
    tensors = []
    for d in (out, full):
        shard = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][name]
        with safe_open(d / shard, "pt") as f:
            tensors.append(f.get_tensor(name))
    assert tensors[0].equal(tensors[1])


def test_dtype_and_config_fields(tmp_path):
    out = _write(tmp_path, "deepseek_v3", dtype="fp32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["torch_dtype"] == "float32" and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["model_type"] == "deepseek_v3" and cfg["rope_scaling"]["type"] == "yarn"
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg["eos_token_id"] and gen["bos_token_id"] == cfg["bos_token_id"]
    with safe_open(sorted(out.glob("model-*.safetensors"))[0], "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype.itemsize == 4
