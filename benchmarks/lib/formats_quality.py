"""Quality of each expert weight format: one MoE layer's output error vs fp32, and the models' next-token KL vs bf16.

    python3 benchmarks/quality.py formats [--json out.json] [--real-model DIR]

Formats: the native engine's bf16, int8, int4 g128, int4 g32 (CpuExperts, its own quantizer), and
GGUF Q8_0 (gguf.quants) and Q4_K (a plain min/max Q4_K encoder here: gguf cannot write K-quants;
llama.cpp's own searches scales and does better), whose decoded weights run in fp32 (what the
torch expert backend computes from a GGUF). Shapes: tiny (E=8, H=256, I=256, top-2) and real
(Qwen3-30B-A3B: E=128, H=2048, I=768, top-8); weights N(0, 0.02) like make-model's; 32 tokens.

KL: whole models, mean over positions of KL(p_bf16 || p_format) of the next-token distributions,
where p_bf16 is the model in bf16 with its routed experts on the torch backend in bf16, and each
format changes only the routed experts: the native engine's bf16/int8/int4 (activations in bf16),
or GGUF Q8_0/Q4_K decoded to fp32 and computed in fp32 on the torch backend (everything else bf16).
Models: tiny (a 2-layer Qwen3-MoE of the shape above, written here) and --real-model, e.g.
`hybridmoe make-model --arch qwen3_moe --preset qwen3-30b-a3b --layers 2 --out DIR` (3.7 GB);
64 random tokens in each of 2 sequences.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import build_model, load_model
from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.cpu_experts import CpuExperts
from hybridmoe.experts.torch_ref import TorchExperts, ref_moe
from hybridmoe.forward_context import Context, use_context
from hybridmoe.models.registry import load_config
from hybridmoe.weights.loader import load_weights
from hybridmoe.weights.quantized import open_checkpoint

from .cli import write_json

SHAPES = {"tiny": (8, 256, 256, 2), "real (Qwen3-30B-A3B)": (128, 2048, 768, 8)}
NATIVE = (("bf16", "bf16", 128), ("int8", "int8", 128), ("int4 g128", "int4", 128), ("int4 g32", "int4", 32))
"""The native engine's formats: (name, format, group size)."""
GGUF = (("Q8_0", Q.Q8_0), ("Q4_K", Q.Q4_K))


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
    for name, fmt, group in NATIVE:
        errors[name] = rel(CpuExperts(gate, up, down, format=fmt, group_size=group).forward(x, ids, wts))
    for name, qtype in GGUF:
        errors[name] = rel(ref_moe(x, *(gguf_roundtrip(w, qtype) for w in (gate, up, down)), ids, wts))
    return errors


class GGUFRoundTripExperts(TorchExperts):
    """The torch expert backend over weights that went through a GGUF type and back, kept in fp32."""

    def __init__(self, qtype: Q):
        super().__init__()
        self.qtype = qtype

    def set_layer(self, layer, gate_proj, up_proj, down_proj):
        # expert by expert: a whole real-shape layer in float32 numpy copies would take several GB
        super().set_layer(layer, *(torch.stack([gguf_roundtrip(w[e].float(), self.qtype) for e in range(w.shape[0])])
                                   for w in (gate_proj, up_proj, down_proj)))


def write_tiny_model(out: Path) -> Path:
    """A 2-layer bf16 Qwen3-MoE whose expert widths (256) every format can encode."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(vocab_size=2048, hidden_size=256, intermediate_size=256, moe_intermediate_size=256,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, initializer_range=0.02,
                            tie_word_embeddings=False)
    Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    return out


@torch.no_grad()
def log_probs(model, sequences: list[list[int]]) -> torch.Tensor:
    """Next-token log-probabilities [sum of lengths, V] float32, one sequence at a time."""
    model.allocate_kv_cache(1, max(len(s) for s in sequences))
    out = []
    for ids in sequences:
        with use_context(Context(slot_ids=[0], start_pos=[0], cu_seqlens=[0, len(ids)])):
            hidden = model(torch.tensor(ids), torch.arange(len(ids)))
        out.append(model.compute_logits(hidden).float().log_softmax(-1))
    return torch.cat(out)


def gguf_model(model_dir: Path, qtype: Q):
    cls, config = load_config(model_dir)
    model = build_model(cls, config, GGUFRoundTripExperts(qtype), torch.bfloat16, "cpu")
    with open_checkpoint(model_dir, config) as ckpt:
        load_weights(model, ckpt, torch.device("cpu"), torch.bfloat16)
    return model


def model_kl(model_dir: Path, tokens: int = 64, sequences: int = 2, seed: int = 0) -> dict[str, float]:
    """Mean KL(p_bf16 || p_format) per format, in nats, over every position of the random sequences."""
    _, config = load_config(model_dir)
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, config.vocab_size, (tokens,), generator=g).tolist() for _ in range(sequences)]
    base = dict(dtype="bfloat16", device="cpu", cache_dir="")
    want = log_probs(load_model(model_dir, EngineConfig(expert_backend="torch", **base)).model, seqs)

    def kl(got: torch.Tensor) -> float:
        return float((want.exp() * (want - got)).sum(-1).mean())

    results = {}
    for name, fmt, group in NATIVE:
        engine = EngineConfig(expert_backend="native", expert_format=fmt, expert_group_size=group, **base)
        results[name] = kl(log_probs(load_model(model_dir, engine).model, seqs))
    for name, qtype in GGUF:
        results[name] = kl(log_probs(gguf_model(model_dir, qtype), seqs))
    return results


def print_table(title: str, rows: dict[str, dict[str, float]], fmt: str) -> None:
    formats = list(next(iter(rows.values())))
    print(f"| {title} | " + " | ".join(formats) + " |")
    print("|---|" + "---|" * len(formats))
    for shape, values in rows.items():
        print(f"| {shape} | " + " | ".join(format(values[f], fmt) for f in formats) + " |")


def add_arguments(parser):
    parser.add_argument("--real-model", type=Path, default=None,
                        help="a real-shape checkpoint for the KL rows (make-model ... --layers 2)")


def run(args) -> int:
    check = torch.randn(4, 256) * 0.02
    if ((gguf_roundtrip(check, Q.Q4_K) - check).norm() / check.norm()) >= 0.15:
        raise HybridMoEError("the Q4_K encoder is broken: its round trip of Gaussian weights errs by 15% or more")
    errors = {shape: layer_errors(*dims) for shape, dims in SHAPES.items()}
    print_table("MoE layer output, relative error vs fp32", errors, ".4f")
    with tempfile.TemporaryDirectory() as tmp:
        kls = {"tiny (Qwen3-MoE, 2 layers, H=256, E=8)": model_kl(write_tiny_model(Path(tmp) / "tiny"))}
    if args.real_model is not None:
        kls[f"real ({args.real_model.name})"] = model_kl(args.real_model)
    print()
    print_table("next-token KL vs bf16, mean nats/token", kls, ".2e")
    write_json(args.json, {"layer_relative_error": errors, "next_token_kl": kls})
    return 0
