"""What reading a layer's experts into the caches ahead of its call (CpuExperts.prefetch) saves a decode call.

    python3 benchmarks/kernel.py prefetch [--shape qwen3-30b-a3b] [--format int4] [--experts 31] [--slots 2]
        [--tokens 1,4] [--layers 16] [--gap-us 40] [--named 1,0.7] [--touch 0,2] [--threads N] [--json F]

Why: in a hybrid decode step the CPU waits for the GPU's attention and router (the e2e anatomy's gap)
and then reads its few experts from DRAM; a layer's routing can be guessed before its attention runs
(`quality.py route-prediction`), so the CPU could fetch them while it waits.

The layer: --experts CPU-resident experts of the shape (the CPU's share under a GPU expert cache:
31 of Qwen3-30B-A3B's 128 at the 16 GiB budget), each token routed to --slots of them. --layers
copies of it (so that each call's weights come from DRAM, as in a decode step) are called in turn,
each after a gap of --gap-us on the calling thread; the variants take turns, in an order rotated
every cycle:
- cold: nothing happens in the gap but waiting;
- warm: in the gap the same call runs once untimed (its weights are then wherever a call leaves them: the
  bound on what any prefetch can give);
- named N touch M: in the gap the engine first prefetches a share N of the experts the call will use
  (N=1: all of them; 0.7 what the route prediction names), reading each line as touch M says
  (0 prefetcht1, 1 prefetcht0, 2 a load, 3 a load + cldemote), then waits out the rest of the gap.
Printed per variant: the call's median time inside the engine (its trace: what the hybrid engine,
calling natively, pays), its ratio to cold's, the prefetch's own median time (it must fit the gap),
and, for cold, the GB/s the call reads and its fraction of the host's read bandwidth (measured in
this run).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch

from hybridmoe.experts.cpu_experts import CpuExperts, default_threads

from .cli import int_list, options, str_list, write_json
from .common import SHAPES, busy_wait, host_read_gbps
from .moe_layer import make_weights, packed_copy


def add_arguments(ap):
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    ap.add_argument("--format", default="int4", choices=["bf16", "int8", "int4"])
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--experts", type=int, default=31, help="CPU-resident experts of the layer (default 31)")
    ap.add_argument("--slots", type=int, default=2, help="experts per token among them (default 2)")
    ap.add_argument("--tokens", default="1,4")
    ap.add_argument("--layers", type=int, default=16, help="copies called in turn (default 16)")
    ap.add_argument("--gap-us", type=float, default=40.0)
    ap.add_argument("--named", default="1,0.7", help="shares of the call's experts prefetched (default 1,0.7)")
    ap.add_argument("--touch", default="0,2", help="prefetch_touch modes to compare (default 0,2)")
    ap.add_argument("--cycles", type=int, default=60)
    ap.add_argument("--threads", type=int)


def make_layers(args, threads: int) -> list[CpuExperts]:
    """--layers copies of one packed layer, each in its own (huge-page) memory, as moe-layer's decode loop."""
    shape = SHAPES[args.shape]
    first = CpuExperts(*make_weights(args.experts, shape["H"], shape["I"]), format=args.format,
                       group_size=args.group_size, threads=threads)
    return [first] + [CpuExperts.from_packed(packed_copy(first.packed_state()), threads=threads)
                      for _ in range(args.layers - 1)]


def routings(T: int, E: int, slots: int, H: int, n: int) -> list[tuple]:
    g = torch.Generator().manual_seed(T)
    out = []
    for _ in range(n):
        ids = torch.stack([torch.randperm(E, generator=g)[:slots] for _ in range(T)]).int()
        out.append((torch.randn(T, H, generator=g).bfloat16(), ids, torch.full((T, slots), 1.0 / slots)))
    return out


def named_experts(ids: torch.Tensor, share: float) -> torch.Tensor:
    """The first round(share * n) of the call's n distinct experts (a prediction that names that share)."""
    distinct = torch.unique(ids)
    return distinct[:round(share * distinct.numel())]


def run(args) -> int:
    threads = args.threads or default_threads()
    shares = [float(s) for s in str_list(args.named)]
    touches = int_list(args.touch)
    variants = [("cold", None, None), ("warm", None, None)] + [(f"named {s:g} touch {t}", s, t) for s in shares for t in touches]
    layers = make_layers(args, threads)
    touch_tunings = {t: replace(layers[0].tuning, prefetch_touch=t) for t in touches}  # EngineTuning.prefetch_touch
    per_expert = layers[0].packed_bytes / args.experts
    bw = host_read_gbps(threads)
    H = SHAPES[args.shape]["H"]
    print(f"# {args.shape} {args.format}: {args.experts} experts x {per_expert / 1e6:.2f} MB, {args.layers} layers, "
          f"{threads} threads, gap {args.gap_us:g} us, host read {bw:.1f} GB/s")
    print(f"{'T':>3} {'variant':<20} {'call us':>8} {'vs cold':>7} {'prefetch us':>11} {'GB/s':>7} {'%bw':>5}")
    rows = []
    for T in int_list(args.tokens):
        calls = routings(T, args.experts, args.slots, H, 32)
        distinct = statistics.mean(torch.unique(ids).numel() for _, ids, _ in calls)
        call_us = {name: [] for name, _, _ in variants}
        pref_us = {name: [] for name, _, _ in variants}
        for cycle in range(args.cycles + 1):
            k = cycle % len(variants)
            for name, share, touch in variants[k:] + variants[:k]:
                for li, layer in enumerate(layers):
                    x, ids, w = calls[(cycle * len(layers) + li) % len(calls)]
                    start = time.perf_counter()
                    if share is not None:
                        layer.tune(touch_tunings[touch])
                        layer.prefetch(named_experts(ids, share))
                        if cycle:
                            pref_us[name].append((time.perf_counter() - start) * 1e6)
                    elif name == "warm":
                        layer.forward(x, ids, w)
                    busy_wait(start + args.gap_us * 1e-6 - time.perf_counter())  # the rest of the gap
                    layer.trace(1)
                    layer.forward(x, ids, w)
                    rec = layer.take_trace()
                    if cycle and rec:  # the first cycle warms up
                        call_us[name].append((rec[0]["end_ns"] - rec[0]["call_ns"]) / 1e3)
        cold = statistics.median(call_us["cold"])
        for name, share, touch in variants:
            us = statistics.median(call_us[name])
            pus = statistics.median(pref_us[name]) if pref_us[name] else 0.0
            gbps = distinct * per_expert / us / 1e3
            rows.append(dict(T=T, variant=name, named=share, touch=touch, call_us=us, vs_cold=us / cold,
                             prefetch_us=pus, gbps=gbps, bw_fraction=gbps / bw, distinct_experts=distinct))
            print(f"{T:>3} {name:<20} {us:>8.1f} {us / cold:>7.2f} {pus:>11.1f} {gbps:>7.1f} {100 * gbps / bw:>4.0f}%",
                  flush=True)
    write_json(args.json, dict(args=options(args), threads=threads,
                               host_read_gbps=bw, rows=rows))
    return 0
