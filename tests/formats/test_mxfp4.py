"""MXFP4 gpt-oss checkpoints (weights/mxfp4.py): the decoder equals transformers' own dequantization bit for bit in
float32; a tiny gpt-oss written as the releases are (mlp.experts.*_blocks / *_scales, quantization_config
quant_method "mxfp4") loads expert by expert and computes what transformers computes after loading the same
directory with Mxfp4Config(dequantize=True); with expert_format auto the native engine keeps the codes in its mxfp4
format, never decoding an expert to float, and holds transformers' weights bit for bit; a layout that does not fit,
an overflowing scale (or one the native format does not hold) or an mxfp4 config on another family fail in one line
naming what."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GptOssConfig, GptOssForCausalLM, Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from hybridmoe.checkpoint import make_checkpoint
from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.errors import CheckpointError
from hybridmoe.forward_context import Context, use_context
from hybridmoe.layers.clamped_swiglu import ClampedSwiGLU
from hybridmoe.weights.mxfp4 import Mxfp4Checkpoint, Mxfp4Experts, dequantize_mxfp4

TINY = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 5,
        "num_experts_per_tok": 2, "sliding_window": 8, "max_position_embeddings": 4096, "swiglu_limit": 0.8}
"""5 experts (an odd count), 2 blocks of 32 per gate_up row (H 64), 1 per down row (I 32)."""

RELEASE_QC = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                         "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}
"""openai/gpt-oss-20b's quantization_config."""

PROMPT = torch.randint(0, 96, (24,), generator=torch.Generator().manual_seed(5)).tolist()
LAYER0 = "model.layers.0.mlp.experts."


def assert_same_bits(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Equal float32 bit patterns (the sign of a zero, an inf included)."""
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype == torch.float32
    assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32))


def random_codes(g, experts: int, rows: int, groups: int, scales=(0, 256)) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), dtype=torch.uint8, generator=g)
    return blocks, torch.randint(*scales, (experts, rows, groups), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("experts, rows, groups", [(3, 7, 2), (1, 1, 1), (5, 64, 3)])
def test_the_decoder_equals_transformers_bit_for_bit_over_every_scale(experts, rows, groups):
    """Random codes under every e8m0 exponent 0..255: the subnormal scales and the ones under which nonzero values
    overflow to inf included."""
    blocks, scales = random_codes(torch.Generator().manual_seed(rows), experts, rows, groups)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    assert_same_bits(dequantize_mxfp4(blocks, scales).transpose(1, 2), theirs)


@pytest.mark.parametrize("scale", [0, 1, 2, 64, 126, 127, 128, 190, 253, 254, 255])
def test_every_byte_at_extreme_scales_equals_transformers(scale):
    """Each of the 256 bytes (all 16 codes in both nibbles) as a row of 16 blocks, under scales each side of 127 out
    to the ends of the range (0: 2^-127, subnormal values; 255: 2^128, zeros stay zero and the rest are inf)."""
    blocks = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 16, 16).expand(3, 2, 16, 16).contiguous()
    scales = torch.full((3, 2, 16), scale, dtype=torch.uint8)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert_same_bits(dequantize_mxfp4(blocks, scales).transpose(1, 2), theirs)


def test_the_nibbles_decode_low_first_to_the_e2m1_values():
    """Byte 0x21 under scale 128 (x2): low nibble 1 (0.5) then high nibble 2 (1.0); 0xF8: -0.0 then -6."""
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, :2] = torch.tensor([0x21, 0xF8], dtype=torch.uint8)
    values = dequantize_mxfp4(blocks, torch.tensor([128], dtype=torch.uint8))
    assert values[:4].tolist() == [1.0, 2.0, -0.0, -12.0] and values[2].signbit()
    assert not values[4:].any()


def write_mxfp4_gpt_oss(path, experts_scale: int = 122, **overrides) -> dict[str, torch.Tensor]:
    """A random tiny gpt-oss saved as the releases are: every layer's gate_up_proj and down_proj replaced by random
    MXFP4 blocks and scales (e8m0 from experts_scale over 3 steps: weights of O(1/sqrt(in))), the float biases,
    sinks and the rest beside them, quantization_config as in config.json. Returns the tensors written."""
    torch.manual_seed(0)
    hf = GptOssForCausalLM(GptOssConfig(**{**TINY, **overrides})).float().eval()
    with torch.no_grad():  # transformers starts biases and sinks at zero: nonzero ones are exercised
        for name, p in hf.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(0, 0.5)
    hf.save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = tensors.pop(name).shape
        tensors[name + "_blocks"], tensors[name + "_scales"] = random_codes(
            g, experts, outputs, inputs // 32, scales=(experts_scale, experts_scale + 3))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": RELEASE_QC}))
    return tensors


def transformers_dequantized(path, dtype=torch.float32) -> GptOssForCausalLM:
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                quantization_config=Mxfp4Config(dequantize=True)).eval()


@torch.no_grad()
def our_logits(model) -> torch.Tensor:
    model.allocate_kv_cache(1, len(PROMPT))
    with use_context(Context(slot_ids=[0], start_pos=[0], cu_seqlens=[0, len(PROMPT)])):
        return model.compute_logits(model(torch.tensor(PROMPT), torch.arange(len(PROMPT))))


def test_an_mxfp4_gpt_oss_computes_what_transformers_computes_from_the_same_directory(tmp_path):
    write_mxfp4_gpt_oss(tmp_path)
    hf = transformers_dequantized(tmp_path)
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0]
    loaded = load_model(tmp_path, EngineConfig(dtype="float32"))
    assert type(loaded.experts).__name__ == "TorchExperts"
    torch.testing.assert_close(our_logits(loaded.model), want, atol=1e-4, rtol=1e-4)


def test_the_experts_decode_one_at_a_time_and_run_in_the_model_dtype(tmp_path, monkeypatch):
    """A bfloat16 load into bf16 experts (decoded to float) never decodes a fused MXFP4 tensor whole (get() refuses
    here); its experts equal transformers' dequantized ones run in bfloat16."""
    write_mxfp4_gpt_oss(tmp_path)
    whole = Mxfp4Checkpoint.get

    def get(self, name):
        assert not name.endswith(("gate_up_proj", "down_proj")), f"{name} decoded whole"
        return whole(self, name)

    monkeypatch.setattr(Mxfp4Checkpoint, "get", get)
    experts = load_model(tmp_path, EngineConfig(dtype="bfloat16", expert_format="bf16")).experts
    theirs = transformers_dequantized(tmp_path, torch.bfloat16).model.layers[1].mlp.experts
    g = torch.Generator().manual_seed(3)
    x = torch.randn(17, TINY["hidden_size"], generator=g).bfloat16()
    ids = torch.stack([torch.randperm(5, generator=g)[:2] for _ in range(17)])
    weights = torch.softmax(torch.randn(17, 2, generator=g), dim=-1).bfloat16()
    with torch.no_grad():
        ours = experts.forward(1, x, ids, weights)
        assert ours.dtype == torch.bfloat16
        torch.testing.assert_close(ours.float(), theirs(x, ids, weights).float(), atol=5e-2, rtol=5e-2)


NATIVE = {"dtype": "float32", "expert_backend": "native", "cpu_threads": 2}
"""The float32 model with its experts in the native engine, expert_format left auto."""


def refuse_float_experts(monkeypatch) -> None:
    """Decoding an MXFP4 expert (or a fused tensor) to float fails from here on."""
    def decoded(*args):
        raise AssertionError("an MXFP4 expert was decoded to float")

    whole = Mxfp4Checkpoint.get
    monkeypatch.setattr(Mxfp4Experts, "__getitem__", decoded)
    monkeypatch.setattr(Mxfp4Checkpoint, "get", lambda self, name: decoded() if name.endswith(
        ("gate_up_proj", "down_proj")) else whole(self, name))


def test_auto_keeps_the_codes_in_the_native_mxfp4_format_bit_for_bit(tmp_path, monkeypatch):
    """No expert goes through float; each layer's gate, up and down dequantize to transformers' decoding exactly."""
    write_mxfp4_gpt_oss(tmp_path)
    refuse_float_experts(monkeypatch)
    loaded = load_model(tmp_path, EngineConfig(**NATIVE))
    monkeypatch.undo()
    assert loaded.engine_config.expert_format == "mxfp4"
    hf = transformers_dequantized(tmp_path)
    for layer in range(TINY["num_hidden_layers"]):
        native, theirs = loaded.experts.layer_experts(layer), hf.model.layers[layer].mlp.experts
        assert native.format == "mxfp4" and native.has_biases
        assert native.glu == ClampedSwiGLU(alpha=1.702, limit=TINY["swiglu_limit"])
        for e in range(TINY["num_local_experts"]):
            gate, up, down = native.dequantized(e)
            gate_up = theirs.gate_up_proj[e].detach()  # [H, 2I], gate and up interleaved by column
            assert_same_bits(gate, gate_up[:, ::2].t().contiguous())
            assert_same_bits(up, gate_up[:, 1::2].t().contiguous())
            assert_same_bits(down, theirs.down_proj[e].detach().t().contiguous())


def test_native_mxfp4_experts_give_transformers_logits(tmp_path):
    """Within the bf16 row of tests/models/compare.py's table, the native engine's tolerance in test_gpt_oss.py (the
    kernels read x and h in bf16)."""
    write_mxfp4_gpt_oss(tmp_path)
    hf = transformers_dequantized(tmp_path)
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0]
    loaded = load_model(tmp_path, EngineConfig(**NATIVE))
    assert loaded.experts.layer_experts(0).format == "mxfp4"
    torch.testing.assert_close(our_logits(loaded.model), want, atol=5e-2, rtol=5e-2)


def test_a_scale_the_native_format_does_not_hold_is_refused_naming_the_tensor_and_expert(tmp_path):
    """A scale outside 2..252 under nonzero codes (255: the OCP spec's NaN) fails at load naming where it is; over a
    block of zero codes it multiplies nothing and loads, as transformers reads it (zeros)."""
    write_mxfp4_gpt_oss(tmp_path)

    def zero_block(tensors):
        tensors[LAYER0 + "down_proj_blocks"][3, 5, 0] = 0
        tensors[LAYER0 + "down_proj_scales"][3, 5, 0] = 255
    rewrite(tmp_path, zero_block)
    down = load_model(tmp_path, EngineConfig(**NATIVE)).experts.layer_experts(0).dequantized(3)[2]
    assert not down[5, :32].any()

    def nonzero_block(tensors):
        tensors[LAYER0 + "down_proj_blocks"][3, 5, 0, 7] = 0x21
    rewrite(tmp_path, nonzero_block)
    with pytest.raises(CheckpointError, match=rf"^tensor {LAYER0}down_proj \(expert 3\) has e8m0 scale 255 at row 5, "
                                              r"block 0 under nonzero codes, outside 2\.\.252"):
        load_model(tmp_path, EngineConfig(**NATIVE))


def test_an_mxfp4_config_over_float_experts_reads_them_as_they_are(tmp_path):
    """Which fused tensors are MXFP4 is read from the files: float experts under an mxfp4 config load."""
    torch.manual_seed(0)
    hf = GptOssForCausalLM(GptOssConfig(**TINY)).float().eval()
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    qc = {**RELEASE_QC, "modules_to_not_convert": [*RELEASE_QC["modules_to_not_convert"], "model.layers.*.mlp"]}
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0]
    loaded = load_model(tmp_path, EngineConfig(dtype="float32"))
    torch.testing.assert_close(our_logits(loaded.model), want, atol=1e-4, rtol=1e-4)


def rewrite(path, change) -> None:
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("change, says", [
    (lambda t: t.update({LAYER0 + "down_proj_scales": torch.zeros(5, 64, 2, dtype=torch.uint8)}),
     (rf"MXFP4 tensor {LAYER0}down_proj_scales has shape \[5, 64, 2\], expected \[5, 64, 1\] \(one e8m0 scale per 32 "
      rf"values of {LAYER0}down_proj_blocks\)")),
    (lambda t: t.pop(LAYER0 + "gate_up_proj_scales"),
     rf"MXFP4 tensor {LAYER0}gate_up_proj_blocks has no {LAYER0}gate_up_proj_scales beside it"),
    (lambda t: t.update({LAYER0 + "down_proj_blocks": torch.zeros(5, 64, 1, 16, dtype=torch.int8)}),
     rf"MXFP4 tensor {LAYER0}down_proj_blocks has dtype int8, expected uint8"),
    (lambda t: t.update({LAYER0 + "down_proj_blocks": torch.zeros(5, 64, 16, dtype=torch.uint8)}),
     rf"MXFP4 tensor {LAYER0}down_proj_blocks has shape \[5, 64, 16\], expected \[experts, rows, blocks, 16\]"),
    (lambda t: t.update({LAYER0 + "gate_up_proj_blocks": torch.zeros(5, 48, 2, 16, dtype=torch.uint8),
                         LAYER0 + "gate_up_proj_scales": torch.zeros(5, 48, 2, dtype=torch.uint8)}),
     rf"tensor {LAYER0}gate_up_proj has shape \[5, 64, 48\], expected \[5, 64, 64\] from config.json"),
], ids=["scales-shape", "no-scales", "blocks-dtype", "blocks-rank", "rows-unlike-config"])
def test_a_layout_that_does_not_fit_fails_in_one_line_naming_the_tensor(change, says, tmp_path):
    write_mxfp4_gpt_oss(tmp_path)
    rewrite(tmp_path, change)
    with pytest.raises(CheckpointError, match=says) as e:
        load_model(tmp_path, EngineConfig(dtype="float32"))
    assert "\n" not in str(e.value)


def test_a_scale_that_overflows_is_refused_naming_the_tensor_and_expert(tmp_path):
    write_mxfp4_gpt_oss(tmp_path)

    def overflow(tensors):
        tensors[LAYER0 + "down_proj_scales"][3, 5, 0] = 255
    rewrite(tmp_path, overflow)
    with pytest.raises(CheckpointError, match=rf"tensor {LAYER0}down_proj \(expert 3\) holds infinite values"):
        load_model(tmp_path, EngineConfig(dtype="float32"))


def test_an_mxfp4_config_on_another_family_fails_at_its_config(tmp_path):
    make_checkpoint("qwen3_moe", "tiny", tmp_path, dtype="fp32", progress=False)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": RELEASE_QC}))
    with pytest.raises(CheckpointError, match="quant_method 'mxfp4' is read for gpt-oss's fused experts only "
                                              r"\(GptOssForCausalLM\), not for Qwen3MoeForCausalLM"):
        load_model(tmp_path, EngineConfig(dtype="float32"))
