"""The fixed cost of one CPU expert call: experts so small that their math is a few microseconds, so
what remains is the call itself (python, grouping, x conversion, item list, waking and joining the
pool's workers, the combine, the return). Variants (CpuExperts.set_schedule's knobs) take turns
call by call in one process, in an order rotated every round.

    python benchmarks/moe_call_overhead.py [--threads 15] [--format int4,bf16] [--tokens 1,4]
        [--variants 'def=;noearly=early_start:0'] [--calls 2000] [--json out.json]

Per (format, T, variant), medians in us: wall (python, untraced calls), then over traced calls:
py>eng (python entry -> the engine has the call), prep (-> the GEMM run starts: grouping, x
conversion unless early_start, item list), run (the GEMM run: math, joins, tail), after (combine
after the run, the return into python: -> python has the result), late (mean / max over workers
of their join after the run started) and math (the items' own time summed over workers).
"""

import argparse
import json
import statistics
import time

import torch

from hybridmoe import CpuExperts
from hybridmoe.experts.cpu_experts import default_threads
from moe_layer import parse_variants, variant_schedules

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


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--format", default="int4,bf16")
    ap.add_argument("--tokens", default="1,4")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--variants", default="def=;noearly=early_start:0")
    ap.add_argument("--calls", type=int, default=2000, help="per variant and cell (every other one traced)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
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
    for fmt in args.format.split(","):
        ex = CpuExperts(*weights, format=fmt, group_size=min(128, H, I), threads=threads)
        schedules = variant_schedules(ex, variants)
        for T in [int(t) for t in args.tokens.split(",")]:
            calls = layer_calls(E, H, K, T)
            walls = {name: [] for name, _ in schedules}
            traced = {name: [] for name, _ in schedules}
            for i in range(args.calls + 100):
                # Rotated each round: no variant always follows the same one (or a traced call).
                for name, schedule in schedules[i % len(schedules):] + schedules[:i % len(schedules)]:
                    ex.set_schedule(**schedule)
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
            for name, _ in schedules:
                m = {k: statistics.median([c[k] for c in traced[name]]) / 1e3 for k in traced[name][0]}
                wall = statistics.median(walls[name]) / 1e3
                rows.append(dict(format=fmt, tokens=T, variant=name, threads=threads, wall_us=wall, **m))
                print(f"{fmt:<6} {T:>3} {name:<8} {wall:>7.2f} | {m['py_eng']:>6.2f} {m['prep']:>6.2f} {m['run']:>6.2f}"
                      f" {m['after']:>6.2f} | {m['late']:>5.2f} {m['late_max']:>5.2f} {m['math']:>6.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": dict(E=E, H=H, I=I, K=K), "threads": threads, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
