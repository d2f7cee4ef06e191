"""One MoE layer's routed experts on the CPU: our engine vs plain torch, same process.

    python3 benchmarks/kernel.py moe-layer --shape qwen3-30b-a3b --format bf16,int8,int4,fp8,mxfp4 \\
        --tokens 1,4,64,512,2048 [--threads N] [--isa amx] [--flush write|read] [--json out.json]
    python3 benchmarks/kernel.py moe-layer --shape qwen3-30b-a3b --format int4 --tokens 1,4 --gap-us 100 \\
        [--layers 8] [--api forward] [--budget-s 5] [--variants 'def=;noearly=early_start:0']

Per (format, T): median ms per call (decode sizes: caches flushed between calls, so weights
come from DRAM), `engine ms` (the part inside the native engine, from its trace over every other
call: python's call and return left out, which a flush makes cold and which the hybrid engine,
calling natively, never pays), GB/s of expert weights read (distinct experts touched x packed bytes
each), TFLOP/s, the host's read bandwidth measured in this run (system/bandwidth.py's probe over 2 GiB
on the same thread count) and our fraction of it, the speedup over a torch bf16 per-expert loop, and
the layer's relative L2 error vs float32 weights (separate Gaussian fp32 experts at this shape).

With --gap-us G: the decode loop instead. --layers layers (each its own packed copy, so the
weights come from DRAM without a cache flush) are called in turn, back to back with G us of
busy work on the calling thread between calls (what a step's GPU attention leaves the CPU
workers), a fresh routing each call; median and p90 ms per call and `engine ms`, for forward()
and for submit() + wait() (the hybrid engine's path), each as a fraction of the read bandwidth
(`%bw eng`: the engine's own time, what a native caller such as the hybrid engine pays; python's
call and return left out). No torch baseline nor accuracy in this mode.
"""

from __future__ import annotations

import mmap
import os
import statistics
import time
from dataclasses import fields, replace

import numpy as np
import torch
import torch.nn.functional as F

from hybridmoe.bench.load_rss import memory_status, reset_peak
from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.cpu_experts import CpuExperts, available_isas, default_threads
from hybridmoe.experts.torch_ref import ref_moe
from hybridmoe.experts.tuning import EngineTuning

from .cli import int_list, str_list, write_json
from .common import SHAPES, busy_wait, cache_flusher, host_read_gbps, layer_shape, prefetching_read_gbps

DECODE_MAX_T = 64  # up to here caches are flushed between calls


def median_ms(fn, reps, flush=None, budget_s=3.0, traced=None):
    """Median ms of fn(); with `traced` (the CpuExperts fn calls) also the median ms the engine
    itself took (its trace: from entering it to its return), over every other call."""
    times, engine = [], []
    start = time.perf_counter()
    for rep in range(reps):
        if flush is not None:
            flush()
        if traced is not None and rep % 2:
            traced.trace(1)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        if traced is not None and rep % 2:
            engine.extend(engine_ms(traced))
        if time.perf_counter() - start > budget_s and len(times) >= 3:
            break
    if traced is None:
        return statistics.median(times)
    return statistics.median(times), statistics.median(engine) if engine else float("nan")


def engine_ms(layer):
    """ms inside the engine of each traced call of `layer` (CpuExperts.take_trace), without python's
    call and return: what the hybrid engine, which calls it natively, pays."""
    return [(r["end_ns"] - r["call_ns"]) / 1e6 for r in layer.take_trace()]


def make_weights(E, H, I, distinct=4):
    """bf16 [E, I, H], [E, I, H], [E, H, I]: `distinct` Gaussian experts repeated, each in its own memory."""
    g = torch.Generator().manual_seed(0)
    d = min(distinct, E)
    mk = lambda a, b, fan: (torch.randn(d, a, b, generator=g) / fan**0.5).bfloat16().repeat(-(-E // d), 1, 1)[:E]
    return mk(I, H, H), mk(I, H, H), mk(H, I, I)


def routing(T, H, E, K, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int()
    w = torch.softmax(torch.randn(T, K, generator=g), -1)
    return torch.randn(T, H, generator=g).bfloat16(), ids, w


def torch_moe(x, gate, up, down, ids, w):
    """The plain torch baseline: bf16 per-expert loop (what transformers does)."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    ids = ids.long()
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        xe = x[tok]
        ye = F.linear(F.silu(F.linear(xe, gate[e])) * F.linear(xe, up[e]), down[e])
        out.index_add_(0, tok, ye.float() * w[tok, slot].unsqueeze(1))
    return out.to(x.dtype)


def accuracy(shape, fmt, group_size, isa, threads):
    """Relative L2 error vs float32 on 8 Gaussian fp32 experts at this shape, 32 tokens."""
    H, I, K = shape["H"], shape["I"], min(shape["K"], 4)
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(8, I, H, generator=g) / H**0.5, torch.randn(8, I, H, generator=g) / H**0.5,
         torch.randn(8, H, I, generator=g) / I**0.5)
    x = torch.randn(32, H, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:K] for _ in range(32)])
    tw = torch.rand(32, K, generator=g)
    ex = CpuExperts(*w, format=fmt, group_size=group_size, threads=threads, isa=isa)
    ref = ref_moe(x, *w, ids, tw)
    return ((ex.forward(x, ids, tw) - ref).norm() / ref.norm()).item()


def peak_rss_reset():
    try:
        reset_peak()
    except OSError:  # no clear_refs here: the growth then counts from the process's start
        pass


def peak_rss_gb():
    return memory_status()["VmHWM"] / 2**30


HUGE_PAGE = 2 << 20


def packed_copy(state, huge=True):
    """A packed_state() whose buffers are fresh copies, each in its own memory: in 2 MiB-aligned
    memory advised for transparent huge pages (huge, as the engine's own packed buffers are),
    else in torch's allocator (4 KiB pages unless THP is "always")."""
    def copy(v):
        if not huge:
            return torch.from_numpy(v).clone()
        m = mmap.mmap(-1, v.nbytes + HUGE_PAGE)
        m.madvise(mmap.MADV_HUGEPAGE)
        base = np.frombuffer(m, dtype=np.uint8)
        start = -base.ctypes.data % HUGE_PAGE
        out = base[start:start + v.nbytes].view(v.dtype).reshape(v.shape)  # keeps the mapping alive
        out[...] = v
        return torch.from_numpy(out)
    return {**state, "buffers": {k: copy(v) for k, v in state["buffers"].items()}}


def parse_variants(spec):
    """--variants 'a=;b=early_start:0,item_blocks:4' -> [(name, {EngineTuning field: int value})]."""
    if not spec:
        return [("", {})]
    out = []
    for part in spec.split(";"):
        name, _, kvs = part.partition("=")
        kw = {k: int(v) for k, v in (kv.split(":") for kv in kvs.split(",") if kv)}
        out.append((name, kw))
    return out


def tuning_with(base: EngineTuning, knobs: dict) -> EngineTuning:
    """base with the knobs of `knobs` ({EngineTuning field: int}, 0/1 for a bool field) replaced."""
    names = [f.name for f in fields(EngineTuning)]
    unknown = sorted(set(knobs) - set(names))
    if unknown:
        raise HybridMoEError(f"unknown knob(s) {', '.join(unknown)}; EngineTuning's: {', '.join(names)}")
    return replace(base, **{k: bool(v) if isinstance(getattr(base, k), bool) else v for k, v in knobs.items()})


def variant_tunings(experts, variants):
    """Each variant's EngineTuning for CpuExperts.tune: the layer's tuning before any variant (the
    engine's defaults) with the variant's knobs, so that a variant's calls never inherit the previous
    variant's knobs."""
    base = experts.tuning
    return [(name, tuning_with(base, kw)) for name, kw in variants]


def decode_loop(args, shape, threads, bw, bw_pf, gate, up, down, tokens):
    """The --gap-us mode: ms per call of layers called in turn with a gap between calls; with
    --variants, the variants take turns cycle by cycle (one cycle: every layer once), in an order
    rotated every round."""
    E, H, K = shape["E"], shape["H"], shape["K"]
    gap_s = args.gap_us * 1e-6
    n_routings = 16  # per layer and T: fresh experts each call, cycled
    variants = parse_variants(args.variants)
    rows = []
    best = max(bw, bw_pf) if bw_pf == bw_pf else bw
    print(f"{'format':<6} {'T':>5} {'api':<7} {'variant':<10} {'ms':>9} {'p90 ms':>9} {'GB/s':>7} {'%bw':>5}"
          f" {'engine ms':>9} {'%bw eng':>7} {'%best':>6}")
    for fmt in str_list(args.format):
        t0 = time.perf_counter()
        first = CpuExperts(gate, up, down, format=fmt, group_size=args.group_size, threads=threads, isa=args.isa)
        # The other layers: copies of the first's packed buffers, in huge pages as the first's
        # are; packing them again would only take longer.
        layers = [first] + [CpuExperts.from_packed(packed_copy(first.packed_state()), threads=threads, isa=args.isa)
                            for _ in range(args.layers - 1)]
        pack_s = time.perf_counter() - t0
        per_expert = layers[0].packed_bytes / E
        tunings = variant_tunings(first, variants)
        for T in tokens:
            calls = [routing(T, H, E, K, seed=1000 * T + r) for r in range(n_routings)]
            touched = statistics.mean(len(torch.unique(ids)) for _, ids, _ in calls)
            for api in args.api.split(","):
                def call(layer, x, ids, w):
                    if api == "forward":
                        layer.forward(x, ids, w)
                    else:
                        layer.submit(x, ids, w)
                        layer.wait()
                times = {name: [] for name, _ in variants}
                engine = {name: [] for name, _ in variants}
                start = time.perf_counter()
                for rep in range(args.reps + 1):
                    # Rotated each cycle: no variant always runs first, or after the same one (a fixed
                    # order drifts along it: docs/decisions.md, "Rows interleaved").
                    for name, tuning in tunings[rep % len(tunings):] + tunings[:rep % len(tunings)]:
                        for layer in layers:
                            layer.tune(tuning)
                        for li, layer in enumerate(layers):
                            x, ids, w = calls[(rep * len(layers) + li) % n_routings]
                            busy_wait(gap_s)
                            if rep % 2:  # every other cycle traced: the engine's own time
                                layer.trace(1)
                            t = time.perf_counter()
                            call(layer, x, ids, w)
                            if rep > 0:  # the first cycle warms up (and learns the gap)
                                times[name].append((time.perf_counter() - t) * 1e3)
                                engine[name].extend(engine_ms(layer))
                    if time.perf_counter() - start > args.budget_s * len(variants) and rep >= 3:
                        break
                for name, _ in variants:
                    ms = statistics.median(times[name])
                    eng_ms = statistics.median(engine[name])
                    p90 = float(np.percentile(times[name], 90))
                    gbps = touched * per_expert / ms / 1e6
                    rows.append(dict(shape=args.shape, format=fmt, mode="decode_loop", api=api, variant=name,
                                     gap_us=args.gap_us, engine_bw_fraction=gbps * ms / eng_ms / bw,
                                     best_bw_fraction=gbps / best, prefetching_read_gbps=bw_pf,
                                     layers=args.layers, isa=layers[0].isa, threads=threads, tokens=T, ms=ms,
                                     p90_ms=p90, engine_ms=eng_ms, calls=len(times[name]), gbps=gbps,
                                     bw_fraction=gbps / bw, pack_s=pack_s, host_read_gbps=bw))
                    print(f"{fmt:<6} {T:>5} {api:<7} {name or '-':<10} {ms:>9.3f} {p90:>9.3f} {gbps:>7.1f}"
                          f" {100 * gbps / bw:>4.0f}% {eng_ms:>9.3f} {100 * gbps * ms / eng_ms / bw:>6.0f}%"
                          f" {100 * gbps / best:>5.0f}%", flush=True)
        print(f"#   {fmt}: {args.layers} layers packed in {pack_s:.1f} s", flush=True)
        del layers
    return rows


def results(args, shape, threads, bw, rows) -> dict:
    """The rows of either mode, with the run's context (the --json file)."""
    return {"shape": args.shape, "dims": shape, "threads": threads, "host_read_gbps": bw,
            "cpu_count": os.cpu_count(), "isas": available_isas(), "rows": rows}


def add_arguments(ap):
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=SHAPES)
    ap.add_argument("--format", default="bf16,int8,int4",
                    help="comma list of expert formats: bf16, int8, int4, fp8 (e4m3, 128x128 block scales), mxfp4 "
                         "(e2m1, an e8m0 scale per 32)")
    ap.add_argument("--tokens", default="1,4,64,512,2048")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--isa", default=None, choices=["generic", "avx2", "avx512", "amx"])
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--experts", type=int, default=None, help="override E (to fit a small machine)")
    ap.add_argument("--top-k", type=int, default=None, help="override the experts per token (e.g. the ~6 of 8 "
                    "a hybrid split leaves on the CPU)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--no-torch", action="store_true", help="skip the torch baseline")
    ap.add_argument("--flush", default="write", choices=["write", "read"],
                    help="how decode sizes evict the caches between calls (common.cache_flusher)")
    ap.add_argument("--gap-us", type=float, default=None,
                    help="decode-loop mode: layers called in turn, this many us apart (see above)")
    ap.add_argument("--layers", type=int, default=8, help="layers cycled in --gap-us mode")
    ap.add_argument("--api", default="forward,submit", help="--gap-us mode: forward and/or submit (submit + wait)")
    ap.add_argument("--variants", default=None,
                    help="--gap-us mode: schedules taking turns cycle by cycle, each its own row, e.g. "
                         "'def=;noearly=early_start:0' (EngineTuning's fields, set by CpuExperts.tune; a knob a "
                         "variant leaves out keeps the engine's default)")
    ap.add_argument("--budget-s", type=float, default=5.0,
                    help="--gap-us mode: seconds per (format, T, api) after which it stops (at least 3 cycles)")


def run(args) -> int:
    shape = layer_shape(args.shape, args.experts, args.top_k)
    E, H, I, K = shape["E"], shape["H"], shape["I"], shape["K"]
    threads = args.threads or default_threads()
    tokens = int_list(args.tokens)
    bw = host_read_gbps(threads)
    if args.gap_us is not None:
        torch.set_num_threads(1)
        time.sleep(1.0)  # torch's OpenMP workers stop spinning on the cores ours are pinned to
        gate, up, down = make_weights(E, H, I)
        bw_pf = prefetching_read_gbps(threads)
        print(f"# {args.shape}: E={E} H={H} I={I} top-{K}; threads={threads}; host read bandwidth {bw:.1f} GB/s "
              f"(plain loads; %bw), {bw_pf:.1f} GB/s (loads with the kernels' prefetches; %best: of the larger); "
              f"decode loop: {args.layers} layers, {args.gap_us:g} us between calls", flush=True)
        rows = decode_loop(args, shape, threads, bw, bw_pf, gate, up, down, tokens)
        write_json(args.json, results(args, shape, threads, bw, rows))
        return 0
    flush = cache_flusher(args.flush)
    peak_rss_reset()
    rss0 = peak_rss_gb()
    gate, up, down = make_weights(E, H, I)
    src_gb = sum(t.numel() * 2 for t in (gate, up, down)) / 2**30
    rows, header = [], None
    calls = {T: routing(T, H, E, K, seed=T) for T in tokens}
    # The torch baseline runs first, on `threads` OpenMP threads; afterwards torch gets one
    # thread and its workers a moment to stop spinning, so they do not share cores with ours.
    torch_ms = {}
    if not args.no_torch:
        torch.set_num_threads(threads)
        for T, (x, ids, w) in calls.items():
            torch_moe(x, gate, up, down, ids, w)
            torch_ms[T] = median_ms(lambda: torch_moe(x, gate, up, down, ids, w), max(3, args.reps // 3),
                                    flush if T <= DECODE_MAX_T else None)
    torch.set_num_threads(1)
    time.sleep(1.0)
    print(f"# {args.shape}: E={E} H={H} I={I} top-{K}; threads={threads}; host read bandwidth {bw:.1f} GB/s; "
          f"isas here: {', '.join(available_isas())}", flush=True)
    for fmt in str_list(args.format):
        peak_rss_reset()
        t0 = time.perf_counter()
        ex = CpuExperts(gate, up, down, format=fmt, group_size=args.group_size, threads=threads, isa=args.isa)
        pack_s = time.perf_counter() - t0
        packed_gb = ex.packed_bytes / 2**30
        rss_gb = peak_rss_gb() - rss0
        per_expert = ex.packed_bytes / E
        measured = []
        for T in tokens:
            x, ids, w = calls[T]
            touched = len(torch.unique(ids))
            decode = T <= DECODE_MAX_T
            ex.forward(x, ids, w)
            measured.append((T, touched, *median_ms(lambda: ex.forward(x, ids, w), args.reps,
                                                    flush if decode else None, traced=ex)))
        err = accuracy(shape, fmt, args.group_size, ex.isa, threads)
        for T, touched, ms, eng_ms in measured:
            gbps = touched * per_expert / ms / 1e6
            row = dict(shape=args.shape, format=fmt, flush=args.flush if T <= DECODE_MAX_T else None,
                       group_size=args.group_size if fmt == "int4" else None,
                       isa=ex.isa, threads=threads, tokens=T, ms=ms, gbps=gbps, bw_fraction=gbps / bw,
                       tflops=2 * 3 * H * I * T * K / ms / 1e9, torch_ms=torch_ms.get(T),
                       speedup=torch_ms[T] / ms if T in torch_ms else None, rel_err_vs_fp32=err, engine_ms=eng_ms,
                       packed_gb=packed_gb, pack_s=pack_s, pack_peak_rss_gb=rss_gb, source_gb=src_gb,
                       host_read_gbps=bw)
            rows.append(row)
            if header is None:
                header = (f"{'format':<6} {'T':>5} {'ms':>9} {'GB/s':>7} {'%bw':>5} {'TFLOP/s':>8} "
                          f"{'torch ms':>9} {'speedup':>8} {'err/fp32':>8} {'engine ms':>9}")
                print(header)
            print(f"{fmt:<6} {T:>5} {ms:>9.3f} {gbps:>7.1f} {100 * gbps / bw:>4.0f}% {row['tflops']:>8.2f} "
                  f"{row['torch_ms'] or float('nan'):>9.2f} {row['speedup'] or float('nan'):>7.1f}x {err:>8.4f}"
                  f" {eng_ms:>9.3f}",
                  flush=True)
        print(f"#   {fmt}: packed {packed_gb:.2f} GiB in {pack_s:.1f} s, peak RSS growth while packing "
              f"{rss_gb:.2f} GiB (source bf16 {src_gb:.2f} GiB)", flush=True)
        del ex
    write_json(args.json, results(args, shape, threads, bw, rows))
    return 0
