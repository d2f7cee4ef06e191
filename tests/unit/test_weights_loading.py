"""The loader reads checkpoints as users download them: sharded, bf16, block-FP8; experts go to the backend."""

import json

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.weights.fp8 import dequant_block_fp8

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def tiny_checkpoint(path, dtype=torch.float32):
    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=40, moe_intermediate_size=24,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2)
    model = Qwen3MoeForCausalLM(config).to(dtype).eval()
    model.save_pretrained(path)
    return model


def all_weights(loaded):
    """Every number the loaded model computes with: its parameters and each layer's stacked experts."""
    params = {n: p.detach().clone() for n, p in loaded.model.named_parameters()}
    for layer in loaded.experts.layers():
        for name, t in zip(("gate", "up", "down"), loaded.experts._weights[layer]):
            params[f"experts.{layer}.{name}"] = t.clone()
    return params


def test_sharded_checkpoint_loads_the_same_weights_as_one_file(tmp_path):
    hf = tiny_checkpoint(tmp_path / "single")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    single, sharded = all_weights(load_model(tmp_path / "single")), all_weights(load_model(tmp_path / "sharded"))
    assert single.keys() == sharded.keys()
    for name in single:
        assert torch.equal(single[name], sharded[name]), name


def test_experts_are_stacked_per_layer_in_checkpoint_order(tmp_path):
    tiny_checkpoint(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    loaded = load_model(tmp_path)
    gate, up, down = loaded.experts._weights[1]
    assert gate.shape == (4, 24, 32) and down.shape == (4, 32, 24)
    assert torch.equal(up[3], tensors["model.layers.1.mlp.experts.3.up_proj.weight"])
    assert torch.equal(down[2], tensors["model.layers.1.mlp.experts.2.down_proj.weight"])


def test_auto_dtype_is_the_checkpoint_dtype_and_can_be_overridden(tmp_path):
    tiny_checkpoint(tmp_path, dtype=torch.bfloat16)
    auto = load_model(tmp_path, EngineConfig(expert_backend="torch"))
    assert auto.dtype == torch.bfloat16
    assert {p.dtype for p in auto.model.parameters()} == {torch.bfloat16}
    assert auto.experts._weights[0][0].dtype == torch.bfloat16
    fp32 = load_model(tmp_path, EngineConfig(dtype="float32"))
    assert {p.dtype for p in fp32.model.parameters()} == {torch.float32}
    assert torch.equal(fp32.model.model.embed_tokens.weight, auto.model.model.embed_tokens.weight.float())


def quantize_block_fp8(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (fp8 [out, in], scale_inv [ceil(out/block), ceil(in/block)]), DeepSeek-V3's layout."""
    rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
    scale = torch.empty(rows, cols)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = blk.abs().max().clamp(min=1e-12) / FP8_MAX
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (blk / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def test_dequant_block_fp8_scales_each_block_including_ragged_edges():
    torch.manual_seed(0)
    w = torch.randn(300, 200)
    q, scale = quantize_block_fp8(w, 128)
    assert scale.shape == (3, 2)
    deq = dequant_block_fp8(q, scale)
    assert torch.equal(deq[290:, 150:], q[290:, 150:].float() * scale[2, 1])
    assert torch.equal(deq[:128, :128], q[:128, :128].float() * scale[0, 0])
    torch.testing.assert_close(deq, w, atol=0, rtol=0.07)  # e4m3 keeps 3 mantissa bits


def test_fp8_checkpoint_loads_dequantized(tmp_path):
    tiny_checkpoint(tmp_path / "fp32")
    tensors = load_file(tmp_path / "fp32" / "model.safetensors")
    fp8, dequantized = {}, {}
    for name, t in tensors.items():
        if name.endswith("proj.weight"):  # every linear, experts included, as DeepSeek-V3 ships them
            q, scale = quantize_block_fp8(t, 16)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            dequantized[name] = q.float() * scale.repeat_interleave(16, 0)[:t.shape[0]].repeat_interleave(16, 1)[:, :t.shape[1]]
        else:
            fp8[name] = dequantized[name] = t
    config = json.loads((tmp_path / "fp32" / "config.json").read_text())
    for sub, weights, extra in (("fp8", fp8, {"quantization_config": {"quant_method": "fp8",
                                                                      "weight_block_size": [16, 16]}}),
                                ("ref", dequantized, {})):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "config.json").write_text(json.dumps({**config, **extra}))
        save_file(weights, tmp_path / sub / "model.safetensors")
    got, want = all_weights(load_model(tmp_path / "fp8")), all_weights(load_model(tmp_path / "ref"))
    assert got.keys() == want.keys()
    for name in got:
        assert torch.equal(got[name], want[name]), name


def test_old_checkpoints_rotary_buffers_are_skipped(tmp_path):
    tiny_checkpoint(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(tensors, tmp_path / "model.safetensors")
    load_model(tmp_path)
