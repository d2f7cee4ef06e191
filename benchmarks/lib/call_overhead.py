"""The fixed cost of one CPU expert call: experts so small that their math is a few microseconds, so
what remains is the call itself (python, grouping, x conversion, item list, waking and joining the
pool's workers, the combine, the return). Variants (EngineTuning's knobs, CpuExperts.tune) take turns
call by call in one process, in an order rotated every round.

    python3 benchmarks/kernel.py call-overhead [--threads 15] [--format int4,bf16] [--tokens 1,4]
        [--variants 'def=;noearly=early_start:0'] [--calls 2000] [--json out.json]

Per (format, T, variant), medians in us: wall (python, untraced calls), then over traced calls:
py>eng (python entry -> the engine has the call), prep (-> the GEMM run starts: grouping, x
conversion unless early_start, item list), run (the GEMM run: math, joins, tail), after (combine
after the run, the return into python: -> python has the result), late (mean / max over workers
of their join after the run started) and math (the items' own time summed over workers).
"""

from __future__ import annotations

import statistics
import time

import torch

from hybridmoe.experts.cpu_experts import CpuExperts, default_threads

from .cli import int_list, str_list, write_json
from .moe_layer import parse_variants, variant_tunings

START, END = 6, 7  # take_trace()'s item columns


def layer_calls(E, H, K, T, n=8):
    out = []
    for s in range(n):
        g = torch.Generator().manual_seed(s)
        out.append((torch.randn(T, H, generator=g).bfloat16(),
                    torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int(),
                    torch.softmax(torch.randn(T, K, generator=g), -1)))
    return out


def breakdown(py0, rec, py1):
    joins = [j - rec["items_ns"] for j in rec["join_ns"].tolist()[1:] if j]
    it = rec["items"]
    return dict(py_eng=rec["call_ns"] - py0, prep=rec["items_ns"] - rec["call_ns"],
                run=rec["gemm_end_ns"] - rec["items_ns"], after=py1 - rec["gemm_end_ns"],
                late=statistics.mean(joins) if joins else float("nan"), late_max=max(joins, default=float("nan")),
                math=float((it[:, END] - it[:, START]).sum()))


def add_arguments(ap):
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--format", default="int4,bf16")
    ap.add_argument("--tokens", default="1,4")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--variants", default="def=;noearly=early_start:0")
    ap.add_argument("--calls", type=int, default=2000, help="per variant and cell (every other one traced)")


def run(args) -> int:
    torch.set_num_threads(1)
    E, H, I, K = args.experts, args.hidden, args.intermediate, args.top_k
    threads = args.threads or default_threads()
    g = torch.Generator().manual_seed(0)
    weights = (torch.randn(E, I, H, generator=g) / H**0.5, torch.randn(E, I, H, generator=g) / H**0.5,
               torch.randn(E, H, I, generator=g) / I**0.5)
    variants = parse_variants(args.variants or "def=")
    print(f"# E={E} H={H} I={I} top-{K}, threads={threads}; us, medians; variants take turns call by call")
    print(f"{'format':<6} {'T':>3} {'variant':<8} {'wall':>7} | {'py>eng':>6} {'prep':>6} {'run':>6} {'after':>6}"
          f" | {'late':>5} {'max':>5} {'math':>6}")
    rows = []
    for fmt in str_list(args.format):
        ex = CpuExperts(*weights, format=fmt, group_size=min(128, H, I), threads=threads)
        tunings = variant_tunings(ex, variants)
        for T in int_list(args.tokens):
            calls = layer_calls(E, H, K, T)
            walls = {name: [] for name, _ in tunings}
            traced = {name: [] for name, _ in tunings}
            for i in range(args.calls + 100):
                # Rotated each round: no variant always follows the same one (or a traced call).
                for name, tuning in tunings[i % len(tunings):] + tunings[:i % len(tunings)]:
                    ex.tune(tuning)
                    if i % 2:
                        ex.trace(1)
                    py0 = time.monotonic_ns()
                    ex.forward(*calls[i % len(calls)])
                    py1 = time.monotonic_ns()
                    if i < 100:  # warm-up
                        ex.take_trace()
                    elif i % 2:
                        traced[name].append(breakdown(py0, ex.take_trace()[0], py1))
                    else:
                        walls[name].append(py1 - py0)
            for name, _ in tunings:
                m = {k: statistics.median([c[k] for c in traced[name]]) / 1e3 for k in traced[name][0]}
                wall = statistics.median(walls[name]) / 1e3
                rows.append(dict(format=fmt, tokens=T, variant=name, threads=threads, wall_us=wall, **m))
                print(f"{fmt:<6} {T:>3} {name:<8} {wall:>7.2f} | {m['py_eng']:>6.2f} {m['prep']:>6.2f} {m['run']:>6.2f}"
                      f" {m['after']:>6.2f} | {m['late']:>5.2f} {m['late_max']:>5.2f} {m['math']:>6.2f}", flush=True)
    write_json(args.json, {"shape": dict(E=E, H=H, I=I, K=K), "threads": threads, "rows": rows})
    return 0
