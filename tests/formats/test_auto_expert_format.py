"""expert_format "auto" picks the native format nearest the checkpoint's own and says so in a log line."""

import json
import logging

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_writer import save_tiny_qwen3, write_qwen3_gguf

from hybridmoe.config import EngineConfig
from hybridmoe.models.registry import load_config
from hybridmoe.system.auto import resolve_engine_config
from hybridmoe.weights.convert import convert_checkpoint
from hybridmoe.weights.gguf_model_dir import resolve_model_path

# K-quants need rows of 256: every expert width of this model is 256
CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=256, moe_intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=4, num_experts_per_tok=2,
              max_position_embeddings=512, rope_theta=1e6, rms_norm_eps=1e-6)


def resolve(model_dir, **options):
    model_dir = resolve_model_path(model_dir, EngineConfig(cache_dir=""))
    _, config = load_config(model_dir)
    ec = EngineConfig(expert_backend="native", dtype="bfloat16", cache_dir="", **options)
    return resolve_engine_config(ec, config, torch.bfloat16, model_dir)


@pytest.fixture(scope="module")
def qwen3_tensors(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auto")
    tensors, saved = save_tiny_qwen3(tmp, CONFIG)
    return tensors, {**CONFIG, **saved}, tmp


@pytest.mark.parametrize("gate_up,down,want", [
    (Q.Q8_0, Q.Q8_0, ("int8", 128)), (Q.Q6_K, Q.Q5_K, ("int8", 128)),
    (Q.Q4_K, Q.Q6_K, ("int4", 32)),  # Q4_K_M: most expert weights are Q4_K
    (Q.Q3_K, Q.Q2_K, ("int4", 32)), (Q.Q4_0, Q.Q4_1, ("int4", 32)), (Q.BF16, Q.F16, ("bf16", 128)),
])
def test_gguf_experts_pick_the_nearest_native_format(qwen3_tensors, tmp_path, caplog, gate_up, down, want):
    tensors, config, tok_dir = qwen3_tensors

    def types(name):
        return (down if "down_proj" in name else gate_up) if ".experts." in name else Q.F32

    write_qwen3_gguf(tensors, config, tok_dir, tmp_path / "model.gguf", types)
    with caplog.at_level(logging.INFO, logger="hybridmoe.weights"):
        ec = resolve(tmp_path / "model.gguf")
    assert (ec.expert_format, ec.expert_group_size) == want
    assert f"routed experts: {want[0]}" in caplog.text and f"{gate_up.name} x" in caplog.text


@pytest.mark.parametrize("method,bits,group,want", [
    ("gptq", 4, 64, ("int4", 64)), ("awq", 4, 32, ("int4", 32)), ("gptq", 4, -1, ("int4", 128)),
    ("gptq", 8, 128, ("int8", 128)),
])
def test_gptq_and_awq_pick_int4_in_their_group_size(tiny_qwen3, tmp_path, caplog, method, bits, group, want):
    config = json.loads((tiny_qwen3 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": bits, "group_size": group}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.INFO, logger="hybridmoe.weights"):
        ec = resolve(tmp_path)
    assert (ec.expert_format, ec.expert_group_size) == want
    assert f"{method.upper()} {bits}-bit g{group}" in caplog.text


def test_float_checkpoints_stay_bf16_and_a_chosen_format_is_kept(tiny_qwen3):
    assert resolve(tiny_qwen3).expert_format == "bf16"
    ec = resolve(tiny_qwen3, expert_format="int8", expert_group_size=64)
    assert (ec.expert_format, ec.expert_group_size) == ("int8", 64)


@pytest.mark.parametrize("options,want", [
    ({"expert_format": "int4"}, ("int4", 64)), ({"expert_format": "int4", "expert_group_size": 32}, ("int4", 32)),
    ({"expert_group_size": 128}, ("int4", 128)), ({"expert_format": "int8"}, ("int8", 128)),
])
def test_a_group_size_left_unset_is_the_4_bit_checkpoints_own_and_one_given_is_kept(tiny_qwen3, tmp_path, options,
                                                                                   want):
    config = json.loads((tiny_qwen3 / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 64}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ec = resolve(tmp_path, **options)
    assert (ec.expert_format, ec.expert_group_size) == want


def test_an_int4_from_float_weights_is_in_groups_of_128(tiny_qwen3):
    assert resolve(tiny_qwen3, expert_format="int4").expert_group_size == 128


def test_a_converted_directory_is_read_in_the_format_it_was_packed_in(tiny_qwen3, tmp_path):
    convert_checkpoint(tiny_qwen3, tmp_path / "conv", format="int4", group_size=32, threads=1, progress=False)
    ec = resolve(tmp_path / "conv")
    assert (ec.expert_format, ec.expert_group_size) == ("int4", 32)
