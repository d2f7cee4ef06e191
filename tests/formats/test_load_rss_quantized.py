"""Peak RSS while loading GGUF and GPTQ/AWQ checkpoints: as in a safetensors load (tests/unit/test_load_rss.py),
each expert's source pages leave the process's RSS once the expert is packed, so the mapped file is never
resident as a whole.

One Qwen3-MoE layer, 64 experts of [512, 1024]: 100.7M expert weights, 56.6 MB of source in GGUF Q4_K
(what Q4_K_M gives most experts), 52 MB in GPTQ/AWQ int4 g128. The margin, 16 MiB, holds the model's other
weights (5 MB) and one expert's float32 copy (6 MB); left resident, the source alone would exceed it 3x.
"""

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_writer import finish, qwen3_metadata, random_kquant, write_tensors
from safetensors.torch import save_file

from hybridmoe.checkpoint.presets import model_config
from hybridmoe.checkpoint.tensors import tensor_specs
from hybridmoe.bench.load_rss import measure_in_subprocess

MARGIN = 16 << 20
LAYER = {"hidden_size": 1024, "moe_intermediate_size": 512, "num_experts": 64, "head_dim": 64,
         "num_attention_heads": 8, "num_key_value_heads": 2}
SMALL = {"hidden_size": 256, "moe_intermediate_size": 256, "num_experts": 4}  # a warm-up of the same kind
GROUP = 128
EXPERT_WEIGHTS = LAYER["num_experts"] * 3 * LAYER["hidden_size"] * LAYER["moe_intermediate_size"]


def _config(layer: dict) -> dict:
    config = model_config("qwen3_moe", "tiny", layers=1)
    config.update(bos_token_id=0, eos_token_id=1, **layer)
    return config


def _expert_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """proj -> [out, in] of one expert's linear."""
    hidden, inter = config["hidden_size"], config["moe_intermediate_size"]
    return {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}


def _dense_tensors(config: dict) -> dict[str, torch.Tensor]:
    """Every tensor but the routed experts, random float32."""
    gen = torch.Generator().manual_seed(0)
    return {s.name: torch.randn(s.shape, generator=gen) * s.std + s.mean
            for s in tensor_specs(config) if ".mlp.experts." not in s.name}


def write_gguf(path: Path, config: dict) -> Path:
    """Dense tensors in F32, routed experts stacked per projection in random Q4_K blocks."""
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    qwen3_metadata(w, config)
    rng = np.random.default_rng(0)
    write_tensors(w, _dense_tensors(config), gguf.MODEL_ARCH.QWEN3MOE, 1, lambda name: Q.F32, rng)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, 1)
    experts = config["num_experts"]
    for proj, (rows, cols) in _expert_shapes(config).items():
        blocks = random_kquant(experts * rows, cols, Q.Q4_K, rng).reshape(experts, rows, -1)
        w.add_tensor(names.get_name(f"model.layers.0.mlp.experts.{proj}_proj.weight", try_suffixes=(".weight",)),
                     blocks, raw_dtype=Q.Q4_K)
    finish(w)
    return path


def _words(shape: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    """int32 words, each eight random 4-bit codes."""
    return torch.randint(-(1 << 31), 1 << 31, shape, dtype=torch.int32, generator=gen)


def _packed_linear(base: str, out_features: int, in_features: int, method: str, gen) -> dict[str, torch.Tensor]:
    groups = in_features // GROUP
    scales = (torch.rand(groups, out_features, generator=gen) * 0.01 + 0.001).half()
    zeros = _words((groups, out_features // 8), gen)
    if method == "awq":
        return {f"{base}.qweight": _words((in_features, out_features // 8), gen), f"{base}.qzeros": zeros,
                f"{base}.scales": scales}
    return {f"{base}.qweight": _words((in_features // 8, out_features), gen), f"{base}.qzeros": zeros,
            f"{base}.scales": scales, f"{base}.g_idx": torch.arange(in_features, dtype=torch.int32) // GROUP}


def write_quantized(out: Path, config: dict, method: str) -> Path:
    """Dense tensors in bf16, routed experts as random 4-bit GPTQ or AWQ (GEMM) codes in groups of GROUP."""
    gen = torch.Generator().manual_seed(0)
    tensors = {n: t.bfloat16() for n, t in _dense_tensors(config).items()}
    for e in range(config["num_experts"]):
        for proj, (rows, cols) in _expert_shapes(config).items():
            tensors |= _packed_linear(f"model.layers.0.mlp.experts.{e}.{proj}_proj", rows, cols, method, gen)
    qc = ({"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
          if method == "awq" else
          {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False, "sym": False})
    out.mkdir()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config | {"quantization_config": qc}))
    return out


def _write(kind: str, root: Path, layer: dict) -> Path:
    if kind == "gguf":
        return write_gguf(root / "model.gguf", _config(layer))
    return write_quantized(root / "model", _config(layer), kind)


def _load(model_dir: Path, warmup_dir: Path, expert_format: str) -> dict:
    options = {"device": "cpu", "expert_backend": "native", "expert_format": expert_format, "cache_dir": "",
               "cpu_threads": 2}
    return measure_in_subprocess(model_dir, options, warmup_dir, timeout=300)


# bf16: every expert is dequantized to float and packed, one at a time. "auto" from GPTQ g128: int4 g128 codes
# as they are, which the engine takes for a whole layer at once: the layer's codes, one byte a weight (plus
# float32 scales and zeros, 1/16 of that), are held once beside the packed experts, never a second stacked copy.
@pytest.mark.parametrize("kind,expert_format", [("gguf", "bf16"), ("awq", "bf16"), ("gptq", "auto")])
def test_source_pages_leave_rss_while_packing(kind, expert_format, tmp_path):
    (tmp_path / "warmup").mkdir()
    model, warmup = _write(kind, tmp_path, LAYER), _write(kind, tmp_path / "warmup", SMALL)
    r = _load(model, warmup, expert_format)
    assert r["at_peak"]["RssFile"] < MARGIN, r
    held = 0 if expert_format == "bf16" else EXPERT_WEIGHTS * (1 + 2 * 4 / GROUP)
    assert r["peak_growth"] <= 1.2 * r["packed_bytes"] + held + MARGIN, r
