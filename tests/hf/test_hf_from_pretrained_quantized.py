"""hybridmoe.hf.from_pretrained on quantized checkpoints as they are released: a tiny block-FP8 DeepSeek-V3 (written
by hybridmoe.checkpoint.make_checkpoint as DeepSeek ships one: X.weight float8_e4m3fn beside X.weight_scale_inv,
routed experts included) and a tiny MXFP4 gpt-oss (its experts' *_blocks and *_scales, as openai ships them;
tests/formats/test_mxfp4.py writes it, tests/ being on sys.path).

The reference is the untouched transformers model loaded from the same checkpoint dequantized to float32 by a
decoder independent of hybridmoe's: for block FP8 this file's own e4m3 decode (sign, exponent, mantissa) times each
128x128 block's scale, for MXFP4 transformers' own convert_moe_packed_tensors. With expert_format "auto" the
engine holds the checkpoint's codes (CpuExperts.format fp8 / mxfp4), every expert's weights equal the reference's
bit for bit (both decodes are exact in float32), the other weights equal the reference's bit for bit, and the
logits agree within the native engine's tolerance for its fp8 / mxfp4 formats, 5e-2 (tests/formats/test_mxfp4.py,
test_gpt_oss.py: the kernels read the experts' input and activations in bf16). Another expert_format converts
each expert. Any other quantization is refused in one line naming it; an MXFP4 scale the engine does not hold is
refused naming its layer and expert.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from formats.test_mxfp4 import write_mxfp4_gpt_oss
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from hybridmoe.checkpoint.make import make_checkpoint
from hybridmoe.errors import HybridMoEError
from hybridmoe.hf import OffloadedExperts, from_pretrained

PROMPT = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(5))

NATIVE_TOL = {"atol": 5e-2, "rtol": 5e-2}
"""The native engine's fp8 / mxfp4 tolerance against a float32 reference (tests/formats/test_mxfp4.py)."""

def decode_e4m3(codes: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn codes -> float32 from their bits: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0
    is subnormal, S.1111.111 is NaN."""
    bits = codes.view(torch.uint8).long()
    sign = torch.where(bits >> 7 == 1, -1.0, 1.0)
    exponent, mantissa = (bits >> 3) & 0xF, (bits & 0x7).double()
    normal = (1 + mantissa / 8) * torch.pow(2.0, (exponent - 7).double())
    subnormal = mantissa / 8 * 2.0 ** -6
    value = sign * torch.where(exponent == 0, subnormal, normal)
    return torch.where((exponent == 15) & (mantissa == 7), torch.nan, value).float()


def block_fp8_dequantized(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every block-FP8 weight decoded to float32 times its 128x128 block's scale_inv; the scales dropped."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            scale = tensors[name + "_scale_inv"].float()
            rows, cols = t.shape
            t = decode_e4m3(t) * scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
        out[name] = t.float()
    return out


def mxfp4_dequantized(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every MXFP4 pair X_blocks, X_scales decoded by transformers into the float X [E, in, out]."""
    out = {name: t for name, t in tensors.items() if not name.endswith(("_blocks", "_scales"))}
    for name in [n for n in tensors if n.endswith("_blocks")]:
        base = name.removesuffix("_blocks")
        out[base] = convert_moe_packed_tensors(tensors[name], tensors[base + "_scales"], dtype=torch.float32)
    return out


def write_float_twin(src, dst, dequantize) -> None:
    """dst: src's config without its quantization_config and its weights dequantized, in one float32 file."""
    dst.mkdir()
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(file))
    save_file(dequantize(tensors), dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """format -> (the quantized checkpoint, its float32 twin)."""
    root = tmp_path_factory.mktemp("quantized")
    make_checkpoint("deepseek_v3", "tiny", root / "fp8", dtype="fp8", progress=False)
    write_mxfp4_gpt_oss(root / "mxfp4")
    write_float_twin(root / "fp8", root / "fp8_float", block_fp8_dequantized)
    write_float_twin(root / "mxfp4", root / "mxfp4_float", mxfp4_dequantized)
    return {fmt: (root / fmt, root / f"{fmt}_float") for fmt in ("fp8", "mxfp4")}


def offloaded(model) -> dict[str, OffloadedExperts]:
    return {name: m for name, m in model.named_modules() if isinstance(m, OffloadedExperts)}


def reference_experts(module, transposed: bool, interleaved: bool):
    """transformers' Experts module's experts as (gate [I, H], up [I, H], down [H, I]) each."""
    for e in range(module.gate_up_proj.shape[0]):
        gate_up, down = module.gate_up_proj[e], module.down_proj[e]
        if transposed:
            gate_up, down = gate_up.T, down.T
        gate, up = (gate_up[0::2], gate_up[1::2]) if interleaved else gate_up.chunk(2)
        yield gate, up, down


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@torch.no_grad()
def test_auto_keeps_the_codes_and_gives_the_dequantized_models_logits(checkpoints, fmt):
    path, float_twin = checkpoints[fmt]
    ours = from_pretrained(path, torch_dtype=torch.float32, cpu_threads=1)
    want = AutoModelForCausalLM.from_pretrained(float_twin, dtype=torch.float32).eval()
    assert getattr(ours.config, "quantization_config", None) is None
    assert {p.dtype for p in ours.parameters()} == {torch.float32}
    experts = offloaded(ours)
    assert experts and {m.cpu_experts.format for m in experts.values()} == {fmt}
    gpt_oss = fmt == "mxfp4"
    for name, module in experts.items():
        theirs = reference_experts(want.get_submodule(name), transposed=gpt_oss, interleaved=gpt_oss)
        for e, expected in enumerate(theirs):
            for got, w in zip(module.cpu_experts.dequantized(e), expected):
                assert torch.equal(got, w), f"{name} expert {e}"
    state, want_state = ours.state_dict(), want.state_dict()
    assert state.keys() == {k for k in want_state if ".experts." not in k}
    assert all(torch.equal(state[k], want_state[k]) for k in state), "the non-expert weights differ"
    torch.testing.assert_close(ours(PROMPT).logits, want(PROMPT).logits, **NATIVE_TOL)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@torch.no_grad()
def test_another_format_converts_each_expert(checkpoints, fmt):
    path, float_twin = checkpoints[fmt]
    ours = from_pretrained(path, torch_dtype=torch.float32, expert_format="bf16", cpu_threads=1)
    want = AutoModelForCausalLM.from_pretrained(float_twin, dtype=torch.float32).eval()
    assert {m.cpu_experts.format for m in offloaded(ours).values()} == {"bf16"}
    torch.testing.assert_close(ours(PROMPT).logits, want(PROMPT).logits, **NATIVE_TOL)


def test_another_quantization_is_refused_in_one_line_naming_it(checkpoints, tmp_path):
    path = tmp_path / "gptq"
    shutil.copytree(checkpoints["fp8"][1], path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HybridMoEError, match=r"is quantized with gptq, which hybridmoe.hf.from_pretrained does not "
                                             r"read \(it reads float, block-FP8 fp8 and MXFP4 mxfp4 checkpoints\)$"):
        from_pretrained(path)


def test_block_fp8_in_other_blocks_is_refused(checkpoints, tmp_path):
    path = tmp_path / "blocks"
    shutil.copytree(checkpoints["fp8"][0], path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [64, 64]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HybridMoEError, match=r"is block FP8 in \[64, 64\] blocks; .* reads \[128, 128\] blocks"):
        from_pretrained(path)


def test_a_scale_the_engine_does_not_hold_is_refused_naming_layer_and_expert(tmp_path):
    write_mxfp4_gpt_oss(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.1.mlp.experts.down_proj_scales"][3, 0, 0] = 255
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HybridMoEError, match=r"model\.layers\.1\.mlp\.experts: expert 3's down scale 255 at row 0"):
        from_pretrained(tmp_path, torch_dtype=torch.float32, cpu_threads=1)
