"""GPTQ (desc_act, v1 zeros) and AWQ (GEMM) checkpoints, made here by quantizing a tiny model, load and
compute what transformers computes with the weights they stand for."""

import json
import re

import pytest
import torch
from int4_packing import AWQ_ORDER, pack
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.forward_context import Context, use_context
from hybridmoe.weights.safetensors import SafetensorsCheckpoint

GROUP = 32
PROMPT = [5, 17, 3, 60, 22, 9, 41]
QUANTIZED = re.compile(r".*(self_attn\.[qkvo]_proj|experts\.\d+\.(gate|up|down)_proj)\.weight")


def rtn(w: torch.Tensor, groups: torch.Tensor):
    """Asymmetric 4-bit round-to-nearest of w [out, in] per (row, group of input channels)."""
    n = int(groups.max()) + 1
    scales = torch.empty(n, w.shape[0], dtype=torch.float16)
    zeros = torch.empty(n, w.shape[0], dtype=torch.int64)
    for g in range(n):
        cols = w[:, groups == g]
        lo, hi = cols.min(1).values.clamp(max=0), cols.max(1).values.clamp(min=0)
        scales[g] = ((hi - lo) / 15).clamp(min=1e-6).half()
        zeros[g] = (-lo / scales[g].float()).round().clamp(0, 15).long()
    s, z = scales.float()[groups].T, zeros[groups].T  # [out, in]
    q = (w / s).round().add(z).clamp(0, 15).long()
    return q, scales, zeros, (q - z).float() * s


def quantize_checkpoint(src, out, method):
    with SafetensorsCheckpoint(src) as ckpt:
        tensors = {n: ckpt.get(n) for n in ckpt.weight_names()}
    packed, decoded = {}, {}
    gen = torch.Generator().manual_seed(0)
    for name, w in tensors.items():
        if not QUANTIZED.fullmatch(name):
            packed[name] = decoded[name] = w
            continue
        base, in_features = name[: -len(".weight")], w.shape[1]
        if method == "gptq":  # desc_act: channels join groups in a shuffled order
            g_idx = torch.empty(in_features, dtype=torch.int32)
            g_idx[torch.randperm(in_features, generator=gen)] = torch.arange(in_features, dtype=torch.int32) // GROUP
        else:
            g_idx = torch.arange(in_features, dtype=torch.int32) // GROUP
        q, scales, zeros, decoded[name] = rtn(w.float(), g_idx.long())
        if method == "gptq":
            packed |= {base + ".qweight": pack(q.T, 0), base + ".qzeros": pack(zeros - 1, 1),
                       base + ".scales": scales, base + ".g_idx": g_idx}
        else:
            packed |= {base + ".qweight": pack(q.T, 1, AWQ_ORDER), base + ".qzeros": pack(zeros, 1, AWQ_ORDER),
                       base + ".scales": scales}
    config = json.loads((src / "config.json").read_text())
    for d, tensors_, qc in ((out / method, packed, True), (out / "ref", decoded, False)):
        d.mkdir(exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors_.items()}, d / "model.safetensors", metadata={"format": "pt"})
        cfg = dict(config)
        if qc:
            cfg["quantization_config"] = (
                {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True, "sym": False,
                 "checkpoint_format": "gptq"} if method == "gptq" else
                {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"})
        (d / "config.json").write_text(json.dumps(cfg))
    return out / method, out / "ref"


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_quantized_checkpoint_equals_transformers_on_its_weights(tiny_qwen3, tmp_path, method):
    quantized, ref = quantize_checkpoint(tiny_qwen3, tmp_path, method)
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32)(torch.tensor([PROMPT])).logits[0]
    model = load_model(quantized, EngineConfig(dtype="float32", cache_dir="")).model
    model.allocate_kv_cache(1, 16)
    with torch.no_grad(), use_context(Context(slot_ids=[0], start_pos=[0], cu_seqlens=[0, len(PROMPT)])):
        got = model.compute_logits(model(torch.tensor(PROMPT), torch.arange(len(PROMPT))))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
