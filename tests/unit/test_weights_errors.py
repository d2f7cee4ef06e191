"""Each way a model directory can be unusable gives one CheckpointError line naming what is wrong."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from hybridmoe.engine.model_loader import load_model
from hybridmoe.errors import CheckpointError


@pytest.fixture
def ckpt(tmp_path):
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=40, moe_intermediate_size=24,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2)
    Qwen3MoeForCausalLM(config).save_pretrained(tmp_path)
    return tmp_path


def edit_tensors(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


def load_error(path) -> str:
    with pytest.raises(CheckpointError) as e:
        load_model(path)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_missing_directory(tmp_path):
    assert "does not exist" in load_error(tmp_path / "nowhere")


def test_directory_without_config(tmp_path):
    assert "no config.json" in load_error(tmp_path)


def test_a_file_of_the_model_names_its_directory(ckpt):
    message = load_error(ckpt / "config.json")
    assert message.endswith(f"is a file; pass the model directory that holds it ({ckpt}) or a .gguf file")


def test_a_directory_of_gguf_files_names_the_file_to_pass(tmp_path):
    (tmp_path / "model-Q4_K_M.gguf").write_bytes(b"GGUF")
    message = load_error(tmp_path)
    assert f"pass the .gguf file itself (e.g. {tmp_path / 'model-Q4_K_M.gguf'}" in message


def test_unsupported_architecture_names_the_supported_ones(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    message = load_error(ckpt)
    assert "LlamaForCausalLM" in message and "Qwen3MoeForCausalLM" in message and "MixtralForCausalLM" in message


def test_truncated_safetensors_names_the_file(ckpt):
    path = ckpt / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    assert "model.safetensors" in load_error(ckpt)


def test_garbage_safetensors_names_the_file(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    assert "model.safetensors" in load_error(ckpt)


def test_no_weight_files(ckpt):
    (ckpt / "model.safetensors").unlink()
    assert "no *.safetensors" in load_error(ckpt)


def test_index_naming_a_missing_shard(ckpt):
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    assert "model-00002-of-00002.safetensors" in load_error(ckpt)


@pytest.mark.parametrize("name", ["model.layers.1.self_attn.k_proj.weight", "model.norm.weight",
                                  "model.layers.0.mlp.experts.2.down_proj.weight"])
def test_missing_tensor_is_named(ckpt, name):
    edit_tensors(ckpt, lambda t: t.pop(name))
    message = load_error(ckpt)
    assert "missing" in message and name in message


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.experts.0.up_proj.weight"])
def test_wrong_shape_is_named(ckpt, name):
    edit_tensors(ckpt, lambda t: t.__setitem__(name, t[name][:-1]))
    message = load_error(ckpt)
    assert name in message and "shape" in message


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.extra.weight", "model.layers.5.mlp.experts.0.up_proj.weight",
                                  "model.layers.0.mlp.experts.9.up_proj.weight"])
def test_leftover_tensor_is_named(ckpt, name):
    edit_tensors(ckpt, lambda t: t.__setitem__(name, torch.zeros(2)))
    message = load_error(ckpt)
    assert name in message and "not part of" in message


def test_fp8_weight_without_its_scale(ckpt):
    name = "model.layers.0.self_attn.o_proj.weight"
    edit_tensors(ckpt, lambda t: t.__setitem__(name, t[name].to(torch.float8_e4m3fn)))
    assert f"{name}_scale_inv" in load_error(ckpt)
