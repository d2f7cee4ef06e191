"""What int8 activations (AMX-INT8) cost in accuracy, per format and scale grouping.

    python3 benchmarks/kernel.py int8-error [--shapes 2048x768,7168x2048] [--tokens 256] [--json F]

AMX-INT8 runs twice as many MACs per tile operation as AMX-BF16 but reads the activations in
int8: x (gate/up) and h = silu(gate x) * (up x) (down), symmetric round-to-nearest with a scale
of amax / 127 per token or per (token, group of K). This models that arithmetic in torch (int32
sums are exact, so only the activation rounding differs from fp32) on Gaussian weights and x, for
each choice of x and h grouping ("bf16": that side stays on bf16 tiles), and prints the layer's
relative L2 error: int4 vs the reference on its own dequantized weights (the issue allows the
kernel 0.01), int8 vs the fp32 weights (the issue's int8 bound is 0.03). "q12": 12 bits per
value, one scale per token (int16 rows rounded to 16 steps, split into an int8 and a 4-bit part
that two byte lanes of one AMX-INT8 product sum exactly against weight bytes (16 w, w)). The row
the AMX int8 kernels run (x per token, h per 128) is also run through isa="amx_emulated", the
kernels' own code, as a check of the model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridmoe.experts.cpu_experts import CpuExperts, available_isas

from .cli import str_list, write_json

# (x grouping, h grouping): 0 one scale per token, G one per G of K, None bf16, "q12" 12 bits per token
CHOICES = [(0, 0), (0, None), (0, 128), (128, None), (64, None), (32, None), (128, 128), (64, 64), ("q12", "q12")]


def int8_rounded(v, group):
    """v [T, K] after symmetric int8 rounding: scale amax / 127 per token (group 0) or per group of K
    (the last one maybe partial)."""
    T, K = v.shape
    group = group or K
    g = F.pad(v, (0, -K % group)).reshape(T, -1, group)
    s = (g.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-30)
    return (torch.round(g / s) * s).reshape(T, -1)[:, :K]


def q12_rounded(v):
    """v [T, K] as AMX int4 reads it: q = round(v / s), s = amax / 32767 per token (the i16 rows),
    then q rounded to a multiple of 16 (saturating at the top: 12 bits)."""
    s = (v.abs().amax(-1, keepdim=True) / 32767).clamp_min(1e-30)
    q = torch.round(v / s)
    return torch.floor((q + 8).clamp_max(32767) / 16) * 16 * s


def rounded(v, choice):
    if choice is None:
        return v.bfloat16().float()
    return q12_rounded(v) if choice == "q12" else int8_rounded(v, choice)


def layer(x, gate, up, down, gx, gh):
    """One expert's output with x and h read as int8 (grouping gx, gh) or bf16 (None)."""
    xq = rounded(x, gx)
    h = F.silu(xq @ gate.T) * (xq @ up.T)
    hq = rounded(h, gh)
    return hq @ down.T


def add_arguments(ap):
    ap.add_argument("--shapes", default="2048x768,7168x2048", help="HxI list")
    ap.add_argument("--tokens", type=int, default=256)


def run(args) -> int:
    name = lambda g: "bf16" if g is None else "tok" if g == 0 else g if g == "q12" else f"g{g}"  # noqa: E731
    choices = [f"{name(a)}/{name(b)}" for a, b in CHOICES]
    print(f"{'format':<9} {'H':>5} {'I':>5} " + " ".join(f"{c:>10}" for c in choices) + f" {'emulated':>9}", flush=True)
    rows = []
    for shape in str_list(args.shapes):
        H, I = (int(v) for v in shape.split("x"))
        for fmt, group in [("int4", 128), ("int4", 32), ("int8", 128)]:
            if fmt == "int4" and (H % group or I % group):
                continue
            g = torch.Generator().manual_seed(0)
            w = (torch.randn(1, I, H, generator=g) / H**0.5, torch.randn(1, I, H, generator=g) / H**0.5,
                 torch.randn(1, H, I, generator=g) / I**0.5)
            x = torch.randn(args.tokens, H, generator=g)
            experts = CpuExperts(*w, format=fmt, group_size=group, threads=2)
            held = experts.dequantized(0)
            base = held if fmt == "int4" else tuple(m[0] for m in w)  # what the error is measured against
            ref = (F.silu(x @ base[0].T) * (x @ base[1].T)) @ base[2].T
            err = lambda out: ((out - ref).norm() / ref.norm()).item()  # noqa: E731
            errors = [err(layer(x, *held, a, b)) for a, b in CHOICES]
            emulated = None
            if fmt == "int8" and "avx512" in available_isas():
                amx = CpuExperts(*w, format=fmt, threads=2, isa="amx_emulated")
                ids, tw = torch.zeros(args.tokens, 1, dtype=torch.long), torch.ones(args.tokens, 1)
                emulated = err(amx.forward(x, ids, tw))
            label = f"{fmt} g{group}" if fmt == "int4" else fmt
            rows.append({"format": label, "H": H, "I": I, "rel_err": dict(zip(choices, errors)), "emulated": emulated})
            print(f"{label:<9} {H:>5} {I:>5} " + " ".join(f"{e:>10.4f}" for e in errors)
                  + f" {'-' if emulated is None else f'{emulated:.4f}':>9}", flush=True)
    write_json(args.json, {"tokens": args.tokens, "rows": rows})
    return 0
