"""Prefill TFLOP/s of one CPU MoE layer vs tokens per expert and weight residency.

Where does prefill time go? Rows with few experts (every token on every expert: the weights
stay in cache and are reused by thousands of tokens) show what the tile kernels compute when
memory does not limit them; rows with all E experts show the same call with the weights
streamed from DRAM once. Both at the same threads, side by side in one run.

    python3 benchmarks/kernel.py prefill-sweep --shape qwen3-30b-a3b --format bf16,int8 --threads 16,8

--split also traces one call per row (CpuExperts.trace) and prints where its time went: the
phases (grouping, x rows, GEMMs, combine, ms) and, summed over the GEMM items, the rate of one
thread in gate/up and in down (TFLOP/s per thread busy in them), the down items' waits for h
and the h conversions (ms of thread time).
"""

from __future__ import annotations

import statistics
import time

import torch

from hybridmoe.experts.cpu_experts import CpuExperts, default_threads

from .cli import int_list, str_list, write_json
from .common import SHAPES


def experts(E, H, I, distinct=4):
    """E experts (gate [I, H], up [I, H], down [H, I], bf16) for CpuExperts.from_experts: `distinct` Gaussian
    experts repeated (expert e is expert e % distinct), as views: never stacked E times in memory
    (DeepSeek-V3's 64 would be 5.6 GB)."""
    g = torch.Generator().manual_seed(0)
    d = min(distinct, E)
    mk = lambda a, b: (torch.randn(d, a, b, generator=g) / b**0.5).bfloat16()
    gate, up, down = mk(I, H), mk(I, H), mk(H, I)
    return [(gate[e % d], up[e % d], down[e % d]) for e in range(E)]


def routing(T, H, E, K):
    g = torch.Generator().manual_seed(T)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int()
    return torch.randn(T, H, generator=g).bfloat16(), ids, torch.softmax(torch.randn(T, K, generator=g), -1)


def split(ex, x, ids, tw, H, I):
    """One traced call: its phases (ms) and per-thread rates of the gate/up and down items."""
    ex.trace(1)
    ex.forward(x, ids, tw)
    rec = ex.take_trace()[0]
    tokens = torch.bincount(ids.flatten().long(), minlength=ex.num_experts)
    it = rec["items"]
    worker, down, expert, b0, b1, start, end, wait, convert = (it[:, c] for c in (0, 1, 2, 4, 5, 6, 7, 8, 9))
    # FLOPs of an item: its rows x K x its expert's tokens x 2 (gate/up: two matrices)
    flops = 2 * 32 * (b1 - b0).double() * tokens[expert].double() * torch.where(down == 1, I, 2 * H)
    busy = (end - start - wait).double()
    rate = lambda d: (flops[down == d].sum() / busy[down == d].sum() / 1e3).item()  # FLOP/ns -> TFLOP/s
    ms = lambda a, b: (rec[b] - rec[a]) / 1e6
    return (f"grouping {ms('entry_ns', 'grouped_ns'):.2f}  x rows {ms('grouped_ns', 'acts_ns'):.2f}  "
            f"gemm {ms('items_ns', 'gemm_end_ns'):.2f}  combine {ms('gemm_end_ns', 'end_ns'):.2f} ms | per thread: "
            f"gate/up {rate(0):.3f}  down {rate(1):.3f} TFLOP/s | down waits {wait.sum().item() / 1e6:.2f}  "
            f"h conversion {convert.sum().item() / 1e6:.2f} ms (thread time)")


def median_ms(fn, reps=5):
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def add_arguments(ap):
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=SHAPES)
    ap.add_argument("--format", default="bf16,int8,int4")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--experts", default="8,all", help="E values (K = min(K, E)); 'all' = the shape's E")
    ap.add_argument("--threads", default=None, help="comma list; default: every allowed CPU")
    ap.add_argument("--isa", default=None)
    ap.add_argument("--split", action="store_true", help="also trace one call per row: where its time went")


def run(args) -> int:
    s = SHAPES[args.shape]
    H, I, T = s["H"], s["I"], args.tokens
    threads = int_list(args.threads) if args.threads else [default_threads()]
    torch.set_num_threads(1)
    print(f"# {args.shape} H={H} I={I} T={T}")
    rows = []
    print(f"{'format':<6} {'E':>4} {'K':>2} {'tok/expert':>10} {'threads':>7} {'ms':>9} {'TFLOP/s':>8}")
    for E in [s["E"] if e == "all" else int(e) for e in str_list(args.experts)]:
        K = min(s["K"], E)
        w = experts(E, H, I)
        x, ids, tw = routing(T, H, E, K)
        for fmt in str_list(args.format):
            for th in threads:
                ex = CpuExperts.from_experts(w, E, format=fmt, threads=th, isa=args.isa)
                ms = median_ms(lambda: ex.forward(x, ids, tw))
                tf = 2 * 3 * H * I * T * K / ms / 1e9
                print(f"{fmt:<6} {E:>4} {K:>2} {T * K // E:>10} {th:>7} {ms:>9.2f} {tf:>8.2f}", flush=True)
                if args.split:
                    print("   ", split(ex, x, ids, tw, H, I), flush=True)
                rows.append(dict(shape=args.shape, format=fmt, experts=E, k=K, tokens=T, threads=th, isa=ex.isa,
                                 ms=ms, tflops=tf))
                del ex
    write_json(args.json, {"shape": args.shape, "dims": s, "rows": rows})
    return 0
