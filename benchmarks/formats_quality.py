"""Quality of each expert weight format: relative error of one MoE layer's output vs fp32, per format.

    python benchmarks/formats_quality.py [--json out.json]

Formats: the native engine's bf16, int8, int4 g128, int4 g32 (CpuExperts, its own quantizer), and
GGUF Q8_0 (gguf.quants) and Q4_K (a plain min/max Q4_K encoder here: gguf cannot write K-quants;
llama.cpp's own searches scales and does better), whose decoded weights run in fp32 (what the
torch expert backend computes from a GGUF). Shapes: tiny (E=8, H=256, I=256, top-2) and real
(Qwen3-30B-A3B: E=128, H=2048, I=768, top-8); weights N(0, 0.02) like make-model's; 32 tokens.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from hybridmoe.experts.cpu_experts import CpuExperts
from hybridmoe.experts.torch_ref import ref_moe

SHAPES = {"tiny": (8, 256, 256, 2), "real (Qwen3-30B-A3B)": (128, 2048, 768, 8)}


def q4_k(w: np.ndarray) -> np.ndarray:
    """w [rows, cols % 256 == 0] -> Q4_K blocks [rows, cols / 256 * 144] (min/max per 32, 6-bit sub-scales)."""
    x = w.reshape(-1, 8, 32).astype(np.float32)  # super-blocks of 8 sub-blocks
    lo = np.minimum(x.min(-1), 0)
    scale = (x.max(-1) - lo) / 15
    d = scale.max(-1, keepdims=True) / 63
    dmin = (-lo).max(-1, keepdims=True) / 63
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    sc = np.clip(np.round(scale / np.where(d16 == 0, 1, d16)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / np.where(dmin16 == 0, 1, dmin16)), 0, 63).astype(np.uint8)
    step = (sc * d16.astype(np.float32))[..., None]
    q = np.clip(np.round((x + (mn * dmin16.astype(np.float32))[..., None]) / np.where(step == 0, 1, step)), 0, 15)
    q = q.astype(np.uint8).reshape(-1, 4, 2, 32)  # 64-value chunks, low/high nibble halves
    packed = np.empty((x.shape[0], 144), np.uint8)
    packed[:, 0:2] = d16.view(np.uint8)
    packed[:, 2:4] = dmin16.view(np.uint8)
    scales = np.empty((x.shape[0], 12), np.uint8)
    scales[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    packed[:, 4:16] = scales
    packed[:, 16:] = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    return packed.reshape(w.shape[0], -1)


def gguf_roundtrip(w: torch.Tensor, qtype: Q) -> torch.Tensor:
    flat = w.reshape(-1, w.shape[-1]).numpy()
    data = q4_k(flat) if qtype == Q.Q4_K else quantize(flat, qtype)
    return torch.from_numpy(dequantize(data, qtype)).reshape(w.shape)


def layer_errors(E, H, I, K, tokens=32, seed=0) -> dict[str, float]:
    g = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(E, I, H, generator=g) * 0.02 for _ in range(2))
    down = torch.randn(E, H, I, generator=g) * 0.02
    x = torch.randn(tokens, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)]).int()
    wts = torch.softmax(torch.randn(tokens, K, generator=g), -1)
    want = ref_moe(x, gate, up, down, ids, wts)

    def rel(out):
        return ((out.float() - want).norm() / want.norm()).item()

    errors = {}
    for name, fmt, group in (("bf16", "bf16", 128), ("int8", "int8", 128), ("int4 g128", "int4", 128),
                             ("int4 g32", "int4", 32)):
        errors[name] = rel(CpuExperts(gate, up, down, format=fmt, group_size=group).forward(x, ids, wts))
    for name, qtype in (("Q8_0", Q.Q8_0), ("Q4_K", Q.Q4_K)):
        errors[name] = rel(ref_moe(x, *(gguf_roundtrip(w, qtype) for w in (gate, up, down)), ids, wts))
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    check = torch.randn(4, 256) * 0.02
    assert ((gguf_roundtrip(check, Q.Q4_K) - check).norm() / check.norm()) < 0.15, "Q4_K encoder is broken"
    results = {shape: layer_errors(*dims) for shape, dims in SHAPES.items()}
    formats = list(next(iter(results.values())))
    print("| MoE layer output, relative error vs fp32 | " + " | ".join(formats) + " |")
    print("|---|" + "---|" * len(formats))
    for shape, errs in results.items():
        print(f"| {shape} | " + " | ".join(f"{errs[f]:.4f}" for f in formats) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
