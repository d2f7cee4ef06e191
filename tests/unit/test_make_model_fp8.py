"""make-model --dtype fp8 writes a block-FP8 checkpoint as DeepSeek-V3 ships one: every linear but the routers
and the output head as e4m3 codes with a float32 weight_scale_inv per 128x128 block, quantization_config naming
it; the engine keeps its routed experts' codes (expert_format auto -> fp8) and computes what the same weights
dequantized to float32 compute."""

import json

import pytest
import torch
from safetensors import safe_open

from hybridmoe.checkpoint import make_checkpoint
from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.errors import HybridMoEError
from hybridmoe.forward_context import Context, use_context
from hybridmoe.weights.fp8 import dequant_block_fp8
from hybridmoe.weights.safetensors import SafetensorsCheckpoint

PROMPT = [5, 17, 3, 60, 22, 9, 41]
SHAPE = {"hidden_size": 160, "moe_intermediate_size": 136}  # two 128-blocks each way, the second partial


def dtypes(model_dir) -> dict[str, str]:
    out = {}
    for path in model_dir.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            out.update((name, f.get_slice(name).get_dtype()) for name in f.keys())
    return out


def logits(model) -> torch.Tensor:
    model.allocate_kv_cache(1, 16)
    with torch.no_grad(), use_context(Context(slot_ids=[0], start_pos=[0], cu_seqlens=[0, len(PROMPT)])):
        return model.compute_logits(model(torch.tensor(PROMPT), torch.arange(len(PROMPT)))).float()


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_fp8_checkpoints_keep_the_routers_and_head_in_bf16(arch, tmp_path):
    make_checkpoint(arch, "tiny", tmp_path, dtype="fp8", progress=False)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [128, 128] and config["torch_dtype"] == "bfloat16"
    found = dtypes(tmp_path)
    for name, dtype in found.items():
        linear = name.endswith(("_proj.weight", "_proj_with_mqa.weight"))
        float32 = name.endswith(("_scale_inv", "e_score_correction_bias"))  # DeepSeek-V3 keeps its bias in float32
        assert dtype == ("F8_E4M3" if linear else "F32" if float32 else "BF16"), name
        assert linear == (name + "_scale_inv" in found), name
    assert found["lm_head.weight"] == "BF16" and found["model.layers.1.mlp.gate.weight"] == "BF16"


def test_the_engine_keeps_the_codes_and_computes_the_dequantized_weights(tmp_path):
    model_dir = tmp_path / "fp8"
    make_checkpoint("deepseek_v3", "tiny", model_dir, dtype="fp8", progress=False, overrides=SHAPE)
    with SafetensorsCheckpoint(model_dir) as ckpt:
        codes, scale_inv = ckpt.fp8_codes("model.layers.1.mlp.experts.3.down_proj.weight")
        # the codes spread the weight over e4m3's range; the scales bring it back to 1/sqrt(fan-in)
        assert 8 < codes.float().std() < 32
        weight = dequant_block_fp8(codes, scale_inv)
        assert 0.5 < weight.std() * 136 ** 0.5 < 2
    loaded = load_model(model_dir, EngineConfig(dtype="float32", expert_backend="native", cache_dir="",
                                                cpu_threads=2))
    assert loaded.experts.layer_experts(1).format == "fp8"
    reference = load_model(model_dir, EngineConfig(dtype="float32", expert_backend="torch"))
    torch.testing.assert_close(logits(loaded.model), logits(reference.model), atol=2e-2, rtol=1.6e-2)


def test_gpt_oss_has_no_block_fp8_checkpoint(tmp_path):
    with pytest.raises(HybridMoEError, match="MXFP4"):
        make_checkpoint("gpt_oss", "tiny", tmp_path, dtype="fp8", progress=False)
