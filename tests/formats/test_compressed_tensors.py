"""compressed-tensors pack-quantized int4 checkpoints (Kimi-K2-Thinking's experts), made here with the
compressed-tensors package's own compressor: the routed experts go into the native int4 engine as codes, never
through float, and equal the package's own decompression bit for bit; the model computes what transformers
computes on the decompressed weights; every other variant fails with one line naming what is not supported."""

import json
import logging
import re

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization.utils import calculate_qparams
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from hybridmoe.checkpoint import make_checkpoint
from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.errors import CheckpointError
from hybridmoe.forward_context import Context, use_context
from hybridmoe.weights.compressed_tensors import CompressedTensorsCheckpoint
from hybridmoe.weights.convert import convert_checkpoint
from hybridmoe.weights.safetensors import SafetensorsCheckpoint

GROUP = 32  # the tiny DeepSeek-V3's experts are [32, 64]: 32 divides both input sizes
PROMPT = [5, 17, 3, 60, 22, 9, 41]
EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
# routed experts, as Kimi-K2-Thinking; and the shared experts, to cover a packed linear outside the experts
PACKED = re.compile(r"model\.layers\.\d+\.mlp\.(experts\.\d+|shared_experts)\.(gate|up|down)_proj\.weight")
NATIVE = {"dtype": "float32", "expert_backend": "native", "cache_dir": "", "cpu_threads": 2}


def int4_args(**changes) -> QuantizationArgs:
    return QuantizationArgs(**{"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                               "group_size": GROUP} | changes)


def quantization_config(args: QuantizationArgs, **changes) -> dict:
    """config.json's quantization_config as the package writes it."""
    qc = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                            format="pack-quantized", quantization_status="compressed",
                            ignore=["lm_head", "re:.*self_attn.*", "re:.*mlp\\.(gate|up|down)_proj.*"])
    return json.loads(qc.model_dump_json()) | changes


def compress(w: torch.Tensor, scheme: QuantizationScheme) -> dict[str, torch.Tensor]:
    """w [out, in] bf16 -> weight_packed, weight_scale (bf16) and weight_shape, by the package's minmax qparams
    and compressor."""
    groups = w.float().unflatten(-1, (-1, GROUP))
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    return PackedQuantizationCompressor.compress(
        {"weight": w, "weight_scale": scale.to(torch.bfloat16), "weight_zero_point": zero}, scheme)


def decompress(parts: dict[str, torch.Tensor], scheme: QuantizationScheme, scale_dtype: torch.dtype) -> torch.Tensor:
    """The package's decompression, its arithmetic in scale_dtype."""
    parts = parts | {"weight_scale": parts["weight_scale"].to(scale_dtype)}
    return PackedQuantizationCompressor.decompress(parts, scheme)["weight"]


@pytest.fixture(scope="module")
def tiny_deepseek_v3(tmp_path_factory):
    out = tmp_path_factory.mktemp("deepseek_v3") / "src"
    make_checkpoint("deepseek_v3", "tiny", out, dtype="fp32", seed=1, progress=False)
    return out


@pytest.fixture(scope="module")
def packed(tiny_deepseek_v3, tmp_path_factory):
    """(the checkpoint with its experts and shared experts pack-quantized, the package's float32 decompression
    of each packed linear, its bf16 decompression as stored)."""
    scheme = QuantizationScheme(targets=["Linear"], weights=int4_args())
    with SafetensorsCheckpoint(tiny_deepseek_v3) as ckpt:
        tensors = {n: ckpt.get(n) for n in ckpt.weight_names()}
    stored, fp32, bf16 = {}, {}, {}
    for name, w in tensors.items():
        if not PACKED.fullmatch(name):
            stored[name] = w
            continue
        parts = compress(w.to(torch.bfloat16), scheme)
        base = name[: -len(".weight")]
        stored |= {f"{base}.{k}": v for k, v in parts.items()}
        fp32[name], bf16[name] = decompress(parts, scheme, torch.float32), decompress(parts, scheme, torch.bfloat16)
    out = tmp_path_factory.mktemp("ct") / "packed"
    write(out, stored, tiny_deepseek_v3, quantization_config=quantization_config(int4_args()))
    return out, fp32, bf16


def write(out, tensors, src, **config_changes):
    out.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(json.loads((src / "config.json").read_text()) | config_changes))
    return out


def reference(tiny_deepseek_v3, tmp_path, decoded):
    """The tiny checkpoint with the packed linears replaced by the package's float32 decompression."""
    with SafetensorsCheckpoint(tiny_deepseek_v3) as ckpt:
        tensors = {n: decoded.get(n, ckpt.get(n)) for n in ckpt.weight_names()}
    return write(tmp_path / "ref", tensors, tiny_deepseek_v3)


def our_logits(model):
    model.allocate_kv_cache(1, 16)
    with torch.no_grad(), use_context(Context(slot_ids=[0], start_pos=[0], cu_seqlens=[0, len(PROMPT)])):
        return model.compute_logits(model(torch.tensor(PROMPT), torch.arange(len(PROMPT))))


def transformers_logits(model_dir):
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(torch.tensor([PROMPT])).logits[0]


def assert_experts_equal(loaded, decoded):
    experts = {n: w for n, w in decoded.items() if EXPERT.fullmatch(n)}
    assert experts
    for name, want in experts.items():
        layer, expert, proj = EXPERT.fullmatch(name).groups()
        got = loaded.experts.layer_experts(int(layer)).dequantized(int(expert))[("gate", "up", "down").index(proj)]
        assert torch.equal(got, want), name


def test_reader_gives_the_packages_decompression_bit_for_bit(packed):
    model_dir, fp32, bf16 = packed
    qc = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    with CompressedTensorsCheckpoint(model_dir, qc) as ckpt:
        names = [n for file_names in ckpt.names_by_file().values() for n in file_names]
        assert set(fp32) <= set(names)
        assert not [n for n in names if n.endswith(("weight_packed", "weight_scale", "weight_shape"))]
        for name, want in fp32.items():
            assert ckpt.shape(name) == tuple(want.shape)
            got = ckpt.get(name)
            assert got.dtype == torch.float32 and torch.equal(got, want), name
            assert torch.equal(got.to(torch.bfloat16), bf16[name]), name  # as stored, rounded as the package does
            codes = ckpt.int4_codes(name)
            assert codes.group == GROUP and codes.zeros is None  # symmetric: W = (code - 8) * scale
            assert torch.equal(codes.dequantize(), want)
        plain = "model.layers.0.self_attn.o_proj.weight"
        assert ckpt.int4_codes(plain) is None and ckpt.get(plain).dtype == torch.float32


def test_native_engine_takes_the_codes_as_they_are(packed, caplog):
    """Symmetric codes go into the native int4 layout without zero points (a sixth less than with them at group
    32), as they are; asked for zero points, the engine writes them out as 8 and computes the same weights."""
    model_dir, fp32, _ = packed
    with caplog.at_level(logging.INFO, logger="hybridmoe.weights"):
        loaded = load_model(model_dir, EngineConfig(**NATIVE))
    assert "routed experts: int4 g32 in the native engine" in caplog.text and "with zero points" not in caplog.text
    assert "compressed-tensors int4 g32" in caplog.text
    assert not loaded.experts.layer_experts(1).packed_state()["zero_points"]
    assert_experts_equal(loaded, fp32)
    with_zeros = load_model(model_dir, EngineConfig(**NATIVE, expert_zero_points=True))
    assert with_zeros.experts.layer_experts(1).packed_state()["zero_points"]
    assert_experts_equal(with_zeros, fp32)


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_logits_match_transformers_on_the_packages_decompression(packed, tiny_deepseek_v3, tmp_path, backend):
    model_dir, fp32, _ = packed
    want = transformers_logits(reference(tiny_deepseek_v3, tmp_path, fp32))
    got = our_logits(load_model(model_dir, EngineConfig(**NATIVE | {"expert_backend": backend})).model)
    # the native engine's activations are int16/bf16: the bf16 tolerance; the torch reference computes in float32
    tol = {"atol": 2e-2, "rtol": 1.6e-2} if backend == "native" else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(got, want, **tol)


def test_convert_keeps_the_codes(packed, tmp_path):
    model_dir, fp32, _ = packed
    summary = convert_checkpoint(model_dir, tmp_path / "out", format="int4", threads=1, progress=False)
    assert (summary.group_size, summary.zero_points) == (GROUP, False)
    assert_experts_equal(load_model(tmp_path / "out", EngineConfig(**NATIVE)), fp32)


UNSUPPORTED_CONFIGS = {
    "asymmetric": (quantization_config(int4_args(symmetric=False)), "asymmetric"),
    "group 16": (quantization_config(int4_args(group_size=16)), "group_size 16"),
    "8 bits": (quantization_config(int4_args(num_bits=8)), "8-bit"),
    "channel": (quantization_config(int4_args(strategy="channel", group_size=None)), "'channel'"),
    "float-quantized": (quantization_config(int4_args(), format="float-quantized"), "format 'float-quantized'"),
    "fp weights": (quantization_config(int4_args(type="float", num_bits=8, strategy="channel", group_size=None)),
                   "float weights"),
    "kv cache": (quantization_config(int4_args(), kv_cache_scheme={"num_bits": 8, "type": "float"}), "KV cache"),
    "activations": ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "weights": json.loads(int4_args().model_dump_json()), "input_activations": {"num_bits": 8}}}},
        "quantized activations"),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED_CONFIGS))
def test_unsupported_variants_fail_in_one_line(tiny_deepseek_v3, tmp_path, case):
    qc, what = UNSUPPORTED_CONFIGS[case]
    with SafetensorsCheckpoint(tiny_deepseek_v3) as ckpt:
        tensors = {n: ckpt.get(n) for n in ckpt.weight_names()}
    model_dir = write(tmp_path / "ckpt", tensors, tiny_deepseek_v3, quantization_config=qc)
    with pytest.raises(CheckpointError, match=re.escape(what)) as err:
        load_model(model_dir, EngineConfig(**NATIVE))
    assert "\n" not in str(err.value) and "not supported" in str(err.value)


def test_a_zero_point_tensor_fails_in_one_line(packed, tmp_path):
    model_dir, _, _ = packed
    with SafetensorsCheckpoint(model_dir) as ckpt:
        tensors = {n: ckpt.get(n) for n in ckpt.file_of}
    tensors["model.layers.1.mlp.experts.0.gate_proj.weight_zero_point"] = torch.zeros(32, 2, dtype=torch.int8)
    src_config = json.loads((model_dir / "config.json").read_text())
    write(tmp_path / "zp", tensors, model_dir)
    with pytest.raises(CheckpointError, match="asymmetric weights \\(weight_zero_point\\)"):
        CompressedTensorsCheckpoint(tmp_path / "zp", src_config["quantization_config"])
