"""Block-FP8 checkpoints as DeepSeek-V3 ships them (e4m3 linears, one weight_scale_inv per 128x128 block): with
expert_format auto the routed experts go into the native fp8 format as stored, never through float, and the
model computes what the float32 checkpoint of the dequantized weights computes. Other block sizes, the hybrid
split's GPU share, `convert` and the expert cache each take them their way."""

import json
import logging
import re

import pytest
import torch
from safetensors.torch import save_file

from hybridmoe.checkpoint import make_checkpoint
from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.experts.cpu_experts import CpuExperts
from hybridmoe.experts.hybrid import HybridExperts
from hybridmoe.forward_context import Context, use_context
from hybridmoe.weights.convert import convert_checkpoint
from hybridmoe.weights.safetensors import SafetensorsCheckpoint

PROMPT = [5, 17, 3, 60, 22, 9, 41]
# hidden 160 and expert width 136: two 128-blocks each way, the second one partial
SHAPE = {"hidden_size": 160, "moe_intermediate_size": 136}
EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
NATIVE = {"dtype": "float32", "expert_backend": "native", "cache_dir": "", "cpu_threads": 2}
# The native engine reads x and h in bf16; the float32 reference does not.
NATIVE_TOLERANCE = {"atol": 2e-2, "rtol": 1.6e-2}


def block_fp8(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (float8_e4m3fn codes, scale_inv [ceil(N / block), ceil(K / block)]): amax / 448 per block."""
    N, K = w.shape
    padded = torch.zeros(-(-N // block) * block, -(-K // block) * block)
    padded[:N, :K] = w
    tiles = padded.unflatten(0, (-1, block)).unflatten(2, (-1, block))  # [rows, block, cols, block]
    scale = tiles.abs().amax(dim=(1, 3)) / 448.0
    codes = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return codes.flatten(2).flatten(0, 1)[:N, :K].contiguous(), scale


def decoded(codes: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    N, K = codes.shape
    return codes.float() * scale.repeat_interleave(block, 0)[:N].repeat_interleave(block, 1)[:, :K]


def write(out, tensors, src, **config_changes):
    out.mkdir()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(json.loads((src / "config.json").read_text()) | config_changes))
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    out = tmp_path_factory.mktemp("deepseek_v3") / "src"
    make_checkpoint("deepseek_v3", "tiny", out, dtype="fp32", seed=1, progress=False, overrides=SHAPE)
    with SafetensorsCheckpoint(out) as ckpt:
        return out, {n: ckpt.get(n) for n in ckpt.weight_names()}


def fp8_checkpoint(source, root, block: int):
    """(the checkpoint with every *_proj linear in block FP8, as DeepSeek-V3's, its float32 twin of the
    dequantized weights, those weights by name)."""
    src, tensors = source
    stored, plain = {}, {}
    for name, w in tensors.items():
        if name.endswith("_proj.weight"):
            codes, scale = block_fp8(w, block)
            stored[name], stored[name + "_scale_inv"] = codes, scale
            plain[name] = decoded(codes, scale, block)
        else:
            stored[name] = plain[name] = w
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [block, block]}
    return (write(root / f"fp8_{block}", stored, src, quantization_config=qc), write(root / f"ref_{block}", plain, src),
            plain)


@pytest.fixture(scope="module")
def fp8_128(source, tmp_path_factory):
    return fp8_checkpoint(source, tmp_path_factory.mktemp("fp8"), 128)


def logits(model):
    model.allocate_kv_cache(1, 16)
    with torch.no_grad(), use_context(Context(slot_ids=[0], start_pos=[0], cu_seqlens=[0, len(PROMPT)])):
        return model.compute_logits(model(torch.tensor(PROMPT), torch.arange(len(PROMPT))))


def cpu_experts_equal(loaded, plain):
    """Every routed expert the native engine holds equals the checkpoint's dequantized weights bit for bit."""
    for name, want in plain.items():
        match = EXPERT.fullmatch(name)
        if match:
            layer, expert, proj = match.groups()
            engine = loaded.experts.layer_experts(int(layer))
            assert engine.format == "fp8"
            got = engine.dequantized(int(expert))[("gate", "up", "down").index(proj)]
            assert torch.equal(got, want), name


def test_auto_keeps_the_checkpoints_codes(fp8_128, caplog, monkeypatch):
    model_dir, ref_dir, plain = fp8_128
    read_as_float = []
    get = SafetensorsCheckpoint.get
    monkeypatch.setattr(SafetensorsCheckpoint, "get", lambda self, name: read_as_float.append(name) or get(self, name))
    with caplog.at_level(logging.INFO, logger="hybridmoe.weights"):
        loaded = load_model(model_dir, EngineConfig(**NATIVE))
    assert "routed experts: fp8" in caplog.text and "block-FP8 e4m3 in 128x128 blocks" in caplog.text
    assert read_as_float and not [n for n in read_as_float if EXPERT.fullmatch(n)]  # never dequantized
    cpu_experts_equal(loaded, plain)
    want = logits(load_model(ref_dir, EngineConfig(dtype="float32", expert_backend="torch")).model)
    torch.testing.assert_close(logits(loaded.model), want, **NATIVE_TOLERANCE)


def test_the_hybrid_splits_gpu_share_takes_the_dequantized_weights(fp8_128):
    model_dir, ref_dir, _ = fp8_128
    hybrid = load_model(model_dir, EngineConfig(**NATIVE, gpu_experts_per_layer=5))
    assert isinstance(hybrid.experts, HybridExperts) and hybrid.experts.gpu_format is None
    want = logits(load_model(ref_dir, EngineConfig(dtype="float32", expert_backend="torch")).model)
    torch.testing.assert_close(logits(hybrid.model), want, **NATIVE_TOLERANCE)


def test_other_block_sizes_auto_to_bf16_and_fp8_requantizes_them(source, tmp_path, caplog):
    model_dir, ref_dir, _ = fp8_checkpoint(source, tmp_path, 16)
    with caplog.at_level(logging.INFO, logger="hybridmoe.weights"):
        auto = load_model(model_dir, EngineConfig(**NATIVE))
    assert "routed experts: bf16" in caplog.text and "16x16 blocks" in caplog.text
    assert auto.experts.layer_experts(1).format == "bf16"
    fp8 = load_model(model_dir, EngineConfig(**NATIVE, expert_format="fp8"))
    want = logits(load_model(ref_dir, EngineConfig(dtype="float32", expert_backend="torch")).model)
    # their 16x16 blocks re-quantized per 128x128 block: e4m3's rounding once more (0.029 measured; bf16 0.003)
    assert ((logits(fp8.model) - want).norm() / want.norm()).item() < 0.05


def test_convert_keeps_the_codes(fp8_128, tmp_path):
    model_dir, _, plain = fp8_128
    summary = convert_checkpoint(model_dir, tmp_path / "out", threads=2, progress=False)
    assert summary.format == "fp8"
    cpu_experts_equal(load_model(tmp_path / "out", EngineConfig(**NATIVE, expert_format="fp8")), plain)


def refuse_packing(*args, **kwargs):
    raise AssertionError("experts were packed again instead of read from the cache")


def test_the_cache_holds_fp8_packed_from_float_but_not_the_checkpoints_codes(fp8_128, source, tmp_path, monkeypatch):
    model_dir, _, _ = fp8_128
    load_model(model_dir, EngineConfig(**NATIVE | {"cache_dir": str(tmp_path / "a")}))
    assert not (tmp_path / "a" / "experts").exists()  # packing copies the codes: nothing to cache
    options = EngineConfig(**NATIVE | {"cache_dir": str(tmp_path / "b"), "expert_format": "fp8"})
    first = load_model(source[0], options)
    assert len(list((tmp_path / "b" / "experts").iterdir())) == 1
    monkeypatch.setattr(CpuExperts, "from_experts", refuse_packing)
    second = load_model(source[0], options)
    for a, b in zip(first.experts.layer_experts(1).dequantized(3), second.experts.layer_experts(1).dequantized(3)):
        assert torch.equal(a, b)
