"""compressed-tensors FP8 checkpoints (format float-quantized, as llm-compressor writes FP8_BLOCK, FP8_DYNAMIC and
static FP8): X.weight e4m3 beside X.weight_scale per 128x128 block, output channel or tensor. The engine computes
what the compressed-tensors package's own dequantization of the same codes computes; 128x128 blocks keep their
codes in the native fp8 format; static activation scales are not read; other variants fail in one line."""

import json

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize
from safetensors.torch import save_file

from hybridmoe.checkpoint import make_checkpoint
from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.errors import CheckpointError
from hybridmoe.forward_context import Context, use_context
from hybridmoe.weights.quantized import open_checkpoint
from hybridmoe.weights.safetensors import SafetensorsCheckpoint

PROMPT = [5, 17, 3, 60, 22, 9, 41]
SHAPE = {"hidden_size": 160, "moe_intermediate_size": 136}  # two 128-blocks each way, the second partial
QUANTIZED = ("_proj.weight", "_proj_with_mqa.weight")
STRATEGIES = {"block": {"strategy": "block", "block_structure": [128, 128]}, "channel": {"strategy": "channel"},
              "tensor": {"strategy": "tensor"}}


def scale_grid(w: torch.Tensor, strategy: str) -> tuple[int, int]:
    """The rows and columns one scale covers."""
    return {"block": (128, 128), "channel": (1, w.shape[1]), "tensor": tuple(w.shape)}[strategy]


def quantize(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (e4m3 codes, weight_scale): amax / 448 over each scale's span, stored as the strategy stores it."""
    rows, cols = scale_grid(w, strategy)
    N, K = w.shape
    padded = torch.zeros(-(-N // rows) * rows, -(-K // cols) * cols)
    padded[:N, :K] = w
    tiles = padded.unflatten(0, (-1, rows)).unflatten(2, (-1, cols))
    scale = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    codes = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn).flatten(2).flatten(0, 1)[:N, :K]
    return codes.contiguous(), scale.reshape(1) if strategy == "tensor" else scale


def quantization_config(name: str, **weights) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                            **STRATEGIES[name], **weights},
                "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                                      "strategy": "token"}}},
            "ignore": ["lm_head", "re:.*mlp.gate$"]}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    out = tmp_path_factory.mktemp("deepseek_v3") / "src"
    make_checkpoint("deepseek_v3", "tiny", out, dtype="fp32", seed=2, progress=False, overrides=SHAPE)
    with SafetensorsCheckpoint(out) as ckpt:
        return out, {n: ckpt.get(n) for n in ckpt.weight_names()}


def write(out, tensors, src, **config_changes):
    out.mkdir()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(json.loads((src / "config.json").read_text()) | config_changes))
    return out


def checkpoints(source, root, strategy):
    """(the compressed-tensors FP8 checkpoint, its float32 twin holding the package's dequantization, those
    dequantized weights by name)."""
    src, tensors = source
    stored, plain = {}, {}
    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, **STRATEGIES[strategy])
    for name, w in tensors.items():
        if name.endswith(QUANTIZED):
            codes, scale = quantize(w, strategy)
            stored[name], stored[name + "_scale"] = codes, scale
            stored[name.removesuffix("weight") + "input_scale"] = torch.tensor([0.02])  # static FP8 activations
            plain[name] = dequantize(codes, scale, None, args, dtype=torch.float32).contiguous()
        else:
            stored[name] = plain[name] = w
    return (write(root / "fp8", stored, src, quantization_config=quantization_config(strategy)),
            write(root / "ref", plain, src), plain)


def logits(model) -> torch.Tensor:
    model.allocate_kv_cache(1, 16)
    with torch.no_grad(), use_context(Context(slot_ids=[0], start_pos=[0], cu_seqlens=[0, len(PROMPT)])):
        return model.compute_logits(model(torch.tensor(PROMPT), torch.arange(len(PROMPT)))).float()


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_the_model_computes_the_packages_dequantization(source, tmp_path, strategy):
    model_dir, ref_dir, plain = checkpoints(source, tmp_path, strategy)
    with SafetensorsCheckpoint(ref_dir) as ref:
        with open_checkpoint(model_dir, json.loads((model_dir / "config.json").read_text())) as ckpt:
            assert not [n for n in ckpt.weight_names() if n.endswith(("_scale", "input_scale"))]
            for name in plain:
                assert torch.equal(ckpt.get(name).float(), ref.get(name)), name
    want = logits(load_model(ref_dir, EngineConfig(dtype="float32", expert_backend="torch")).model)
    got = logits(load_model(model_dir, EngineConfig(dtype="float32", expert_backend="torch")).model)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_128x128_blocks_keep_their_codes_in_the_native_fp8_format(source, tmp_path):
    model_dir, ref_dir, plain = checkpoints(source, tmp_path, "block")
    loaded = load_model(model_dir, EngineConfig(dtype="float32", expert_backend="native", cache_dir="",
                                                cpu_threads=2))
    engine = loaded.experts.layer_experts(1)
    assert engine.format == "fp8"
    assert torch.equal(engine.dequantized(0)[2], plain["model.layers.1.mlp.experts.0.down_proj.weight"])
    want = logits(load_model(ref_dir, EngineConfig(dtype="float32", expert_backend="torch")).model)
    torch.testing.assert_close(logits(loaded.model), want, atol=2e-2, rtol=1.6e-2)


def test_channel_scales_load_as_bf16_experts(source, tmp_path):
    model_dir, _, _ = checkpoints(source, tmp_path, "channel")
    loaded = load_model(model_dir, EngineConfig(dtype="float32", expert_backend="native", cache_dir="",
                                                cpu_threads=2))
    assert loaded.experts.layer_experts(1).format == "bf16"


@pytest.mark.parametrize("weights, message", [
    ({"strategy": "group", "group_size": 128}, "weight strategy 'group'"),
    ({"type": "int"}, "8-bit int weights"),
    ({"num_bits": 4}, "4-bit float weights"),
    ({"symmetric": False}, "asymmetric weights"),
    ({"block_structure": [128]}, "block_structure"),
])
def test_other_variants_fail_in_one_line(source, tmp_path, weights, message):
    model_dir, _, _ = checkpoints(source, tmp_path, "block")
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = quantization_config("block", **weights)
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message) as e:
        load_model(model_dir, EngineConfig(dtype="float32", expert_backend="torch"))
    assert "\n" not in str(e.value)
