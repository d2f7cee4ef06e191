"""Where one CPU MoE decode call's time goes, from the engine's own trace (CpuExperts.trace).

    python3 benchmarks/kernel.py trace --shape qwen3-30b-a3b --format int4,int8,bf16 --tokens 1,4 \\
        --threads 15,16 [--modes loop,sleep,flush] [--api forward,submit] [--item-blocks 0,1,2] [--item-prefetch 0,4096]
        [--tail-split 0,1] [--gate-up-tail 0,1] [--combine-in-run 0,1] [--top-k K] [--deferred D] [--timeline N]
        [--kernel-prefetch-l1 0,2048,4096] [--kernel-prefetch-l2 0,8192]
        [--variants 'new=;old=item_prefetch:0,tail_split:0,combine_in_run:0']
        [--json out.json]

Modes (each call gets a fresh routing, as in `kernel.py moe-layer`):
  loop   moe-layer's --gap-us decode loop: --layers layers (own packed copies, so weights come
         from DRAM) called in turn, --gap-us of busy work between calls; the workers spin.
  sleep  the same layers, --sleep-ms of sleep between calls: the workers have gone to sleep.
  flush  one layer, caches flushed (a 256 MiB write, as moe-layer's table mode) before each
         call: dirty caches and sleeping workers.

--deferred D runs deferral calls (forward_deferred: each token's last D slots summed apart, the own output marked
ready inside the call) and prints their deferred part (`decode.py cpu-trace`'s line); --timeline N prints the first
N traced calls' items per worker.

Per cell, the median over the traced calls of (all in us):
  wall      python time of the call (the same loop untraced beside it: `untraced`)
  floor     bytes read / host read bandwidth (the native probe, as moe-layer); %bw = floor / wall
  py>eng    python entry -> the engine got the call;  hand   -> forward() started (submit: driver)
  group     tokens grouped by expert;  acts  x -> activation rows (on one thread);  build  items
  first     GEMM run start -> first item starts;  gemm  the gate/up + down run
  tail      first worker out of items -> last worker out;  close  last out -> run returns
  comb      combine after the run (up to 16 tokens it runs inside the down items: `combine` on the
            workers line);  ret  forward() done -> back in python
  before / gemm-floor / after: the excess over the floor, split by where it lies
Per worker over the GEMM run (median call; means over workers, and the worst worker):
  late      join - run start (worker 0 is the thread calling run);  slept: workers that had slept
  busy / wait / idle: % of the run spent computing items, waiting for an expert's h, outside items
  gu, dn    GB/s per core while computing gate/up resp. down items;  run  GB/s over the GEMM run
  GB/s by worker: each worker's bytes over its computing time, beside the probe's per-worker
            rates (all threads reading at once, same pool) printed at the top
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import asdict, fields

import numpy as np
import torch

from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.cpu_experts import CpuExperts, _native, default_threads
from hybridmoe.experts.tuning import EngineTuning

from .cli import int_list, str_list, write_json
from .common import SHAPES, busy_wait, cache_flusher, host_read_gbps, layer_shape, prefetching_read_gbps
from .moe_layer import make_weights, packed_copy, parse_variants, routing, tuning_with

WORKER, DOWN, EXPERT, SLICE, B0, B1, START, END, WAIT, CONVERT, DEFERRED = range(11)  # take_trace()'s item columns
N_ROUTINGS = 16


KNOBS = {  # knob -> (its row key's prefix, what its --option's values are)
    "item_blocks": ("ib", "32-row blocks per GEMM item (0: the engine's choice)"),
    "item_prefetch": ("pf", "bytes of each item's weight streams prefetched as it starts"),
    "tail_split": ("tail", "0/1: cut the last down items into 1-block items"),
    "combine_in_run": ("cir", "0/1: few tokens sum the outputs inside the GEMM run"),
    "kernel_prefetch_l1": ("k1_", "bytes ahead the AVX-512 kernels prefetch into L1 (0: none)"),
    "kernel_prefetch_l2": ("k2_", "bytes ahead the AVX-512 kernels prefetch into L2 (0: none)"),
    "gate_up_tail": ("gut", "0/1: cut each side's last gate/up items into 1-block items"),
}
# The knobs with an --option each, at EngineTuning's defaults; a variant changes some of them.
DEFAULT_SCHEDULE = {k: getattr(EngineTuning(), k) for k in KNOBS}


def schedule_variants(args):
    """[(row key suffix, EngineTuning for CpuExperts.tune)]: --variants if given, else every combination of the
    knob lists; knobs a variant leaves out keep EngineTuning's defaults."""
    if args.variants:
        return [(f" {name}" if name else "", tuning_with(EngineTuning(), kw))
                for name, kw in parse_variants(args.variants)]
    values = {k: int_list(getattr(args, k)) for k in DEFAULT_SCHEDULE}  # the knobs' --options
    out = []
    for combo in itertools.product(*values.values()):
        kw = dict(zip(values, combo))
        suffix = "".join(f" {KNOBS[k][0]}{v}" for k, v in kw.items() if len(values[k]) > 1)
        out.append((suffix, tuning_with(EngineTuning(), kw)))
    return out


def med(values):
    return statistics.median(values) if values else float("nan")


def matrix_block_bytes(layer):
    """Packed bytes of one 32-row block of one expert: (gate + up, down), from the buffer sizes."""
    E, H, I = layer._engine.shape
    size = {m: sum(b.nbytes for n, b in layer.packed_state()["buffers"].items() if n.startswith(m + "."))
            for m in ("gate", "up", "down")}
    return (size["gate"] + size["up"]) / (E * -(-I // 32)), size["down"] / (E * -(-H // 32))


def call_breakdown(rec, py0, py1, threads, block_bytes, call_bytes):
    """One traced call -> its numbers (us, GB/s, fractions)."""
    it = rec["items"].numpy()
    us = lambda ns: ns / 1e3
    run_ns = rec["gemm_end_ns"] - rec["items_ns"]
    comp = it[:, END] - it[:, START] - it[:, WAIT]  # computing (down: after its wait)
    out_ns = [int((it[it[:, WORKER] == w][:, END] + it[it[:, WORKER] == w][:, CONVERT]).max())
              for w in range(threads) if (it[:, WORKER] == w).any()]
    busy = np.array([(comp + it[:, CONVERT])[it[:, WORKER] == w].sum() for w in range(threads)])
    wait = np.array([it[it[:, WORKER] == w][:, WAIT].sum() for w in range(threads)])
    joins = rec["join_ns"].numpy()
    late = [us(j - rec["items_ns"]) for j in joins if j]
    gu, dn = it[:, DOWN] == 0, it[:, DOWN] == 1
    nblk = it[:, B1] - it[:, B0]
    gbps = lambda sel, bb: (nblk[sel].sum() * bb) / max(comp[sel].sum(), 1)  # bytes/ns = GB/s
    item_bytes = nblk * np.where(dn, block_bytes[1], block_bytes[0])
    wall = us(py1 - py0)
    before = us(rec["items_ns"] - py0)
    return dict(
        wall=wall, py_eng=us(rec["call_ns"] - py0), hand=us(rec["entry_ns"] - rec["call_ns"]),
        group=us(rec["grouped_ns"] - rec["entry_ns"]), acts=us(rec["acts_ns"] - rec["grouped_ns"]),
        build=us(rec["items_ns"] - rec["acts_ns"]), first=us(it[:, START].min() - rec["items_ns"]),
        gemm=us(run_ns), tail=us(max(out_ns) - min(out_ns)), close=us(rec["gemm_end_ns"] - max(out_ns)),
        comb=us(rec["end_ns"] - rec["gemm_end_ns"]), ret=us(py1 - rec["end_ns"]), before=before,
        after=us(py1 - rec["gemm_end_ns"]),
        late_mean=statistics.mean(late), late_max=max(late), joined=len(late),
        slept=int(rec["slept"].sum()),
        busy=busy.mean() / run_ns, wait=wait.mean() / run_ns, idle=1 - (busy + wait).mean() / run_ns,
        busy_min=busy.min() / run_ns, wait_max=wait.max() / run_ns,
        gu_gbps=gbps(gu, block_bytes[0]), dn_gbps=gbps(dn, block_bytes[1]),
        run_gbps=call_bytes / run_ns, items=len(it), bytes=call_bytes,
        comb_in_run=us(it[dn][:, CONVERT].sum()), convert=us(it[gu][:, CONVERT].sum()),
        late_by_worker=[us(j - rec["items_ns"]) if j else float("nan") for j in joins],
        gbps_by_worker=[float(item_bytes[it[:, WORKER] == w].sum() / max(comp[it[:, WORKER] == w].sum(), 1))
                        if (it[:, WORKER] == w).any() else float("nan") for w in range(threads)])


def deferral_breakdown(rec, block_bytes):
    """A deferral call's deferred part (us, GB/s), None for a call without one: `ready` the own output's
    completion after the GEMM run's start, `after` the call's end after it; the deferred items' computing time
    (all workers) before and after ready, the workers that computed deferred items after it, the waits of the
    deferred down items, and the deferred items' bytes over `after`."""
    if not rec["ready_ns"]:
        return None
    it = np.asarray(rec["items"])
    d = it[it[:, DEFERRED] == 1]
    ready = rec["ready_ns"]
    comp_start = d[:, START] + d[:, WAIT]  # down items compute after their wait
    before = (np.minimum(d[:, END], ready) - np.minimum(comp_start, ready)).sum()
    after = (d[:, END] - np.maximum(comp_start, ready)).clip(min=0).sum()
    nbytes = ((d[:, B1] - d[:, B0]) * np.where(d[:, DOWN] == 1, block_bytes[1], block_bytes[0])).sum()
    after_ns = rec["end_ns"] - ready
    return dict(ready=(ready - rec["items_ns"]) / 1e3, after=after_ns / 1e3, d_items=len(d),
                d_before=before / 1e3, d_after=after / 1e3,
                d_workers=len(set(d[d[:, END] > ready][:, WORKER].tolist())),
                d_wait=d[d[:, DOWN] == 1][:, WAIT].sum() / 1e3, d_gbps=nbytes / max(after_ns, 1))


def deferral_medians(records, block_bytes):
    """deferral_breakdown's values, each the median over the calls that had a deferred part; (None, 0) if none."""
    parts = [p for p in (deferral_breakdown(rec, block_bytes) for rec in records) if p is not None]
    return ({k: med([p[k] for p in parts]) for k in parts[0]} if parts else None), len(parts)


def print_deferral(d, calls, indent=40):
    print(f"{'':<{indent}} deferred part ({calls} calls): own output ready {d['ready']:.1f} us into "
          f"the run, call ends {d['after']:.1f} us after; {d['d_items']:g} deferred items computing "
          f"{d['d_before']:.1f} us before ready and {d['d_after']:.1f} after (all workers), {d['d_workers']:g} "
          f"workers after ready, down items waited {d['d_wait']:.1f} us; {d['d_gbps']:.1f} GB/s after ready")


def print_timeline(rec, indent=40):
    """One call's items per worker, in the order it ran them: g (gate/up) or d (down), D for a deferred slot's
    expert, expert:blocks, then start-end in us from the GEMM run's start (and +wait for down items)."""
    it = np.asarray(rec["items"])
    t0 = rec["items_ns"]
    ready = f", own output ready at {(rec['ready_ns'] - t0) / 1e3:.1f}" if rec["ready_ns"] else ""
    print(f"{'':<{indent}} timeline (us from the run's start; run {(rec['gemm_end_ns'] - t0) / 1e3:.1f}{ready}):")
    for w in sorted(set(it[:, WORKER].tolist())):
        mine = it[it[:, WORKER] == w]
        mine = mine[np.argsort(mine[:, START])]
        waited = lambda r: f"+w{r[WAIT] / 1e3:.0f}" if r[WAIT] > 500 else ""  # waits of half a us or more
        cells = [f"{'d' if r[DOWN] else 'g'}{'D' if r[DEFERRED] else ''}{r[EXPERT]}:{r[B0]}-{r[B1]} "
                 f"{(r[START] - t0) / 1e3:.0f}-{(r[END] - t0) / 1e3:.0f}{waited(r)}" for r in mine]
        print(f"{'':<{indent}}   w{w:<2} " + "  ".join(cells))


def timed_calls(layers, calls, api, mode, reps, gap_s, sleep_s, flush, traced, deferred=0):
    """(py0, py1, record or None) per call after one warm-up cycle; deferred > 0: each token's last `deferred`
    slots as a deferral call's second part (forward_deferred / submit_deferred)."""
    out = []
    for rep in range(reps + 1):
        for li, layer in enumerate(layers):
            x, ids, w = calls[(rep * len(layers) + li) % N_ROUTINGS]
            if mode == "loop":
                busy_wait(gap_s)
            elif mode == "sleep":
                time.sleep(sleep_s)
            else:
                flush()
            if traced:
                layer.trace(1)
            py0 = time.monotonic_ns()
            if api == "forward":
                layer.forward_deferred(x, ids, w, deferred) if deferred else layer.forward(x, ids, w)
            else:
                layer.submit_deferred(x, ids, w, deferred) if deferred else layer.submit(x, ids, w)
                layer.wait()
            py1 = time.monotonic_ns()
            rec = layer.take_trace()[0] if traced else None
            if rep > 0:  # the first cycle warms up (and teaches the pool the gap)
                out.append((py0, py1, rec))
    return out


def cell_medians(stats, threads):
    """call_breakdown's values, each the median over the calls `stats`; late_by_worker and gbps_by_worker
    per worker, over the calls it joined resp. computed in (nan: none)."""
    by_worker = ("late_by_worker", "gbps_by_worker")
    s = {k: med([c[k] for c in stats]) for k in stats[0] if k not in by_worker}
    for k in by_worker:
        s[k] = [med([c[k][w] for c in stats if c[k][w] == c[k][w]]) for w in range(threads)]
    return s


def cell_header(label):
    """The column heads of print_cell's first line, `label` over its key."""
    return (f"{label:<40} {'n':>4} {'untraced':>8} {'wall':>7} {'floor':>6} {'%bw':>5} |"
            f" {'py>eng':>6} {'hand':>5} {'group':>5} {'acts':>5} {'build':>5} {'first':>5} | {'gemm':>6} {'tail':>5}"
            f" {'close':>5} | {'comb':>5} {'ret':>5} | {'before':>6} {'g-flr':>6} {'after':>5}   (us, medians)")


def print_cell(key, n, untraced, floor_us, s, lateness, worker_gbps):
    pct = lambda v: f"{100 * v:5.1f}"
    print(f"{key:<40} {n:>4} {untraced:>8.1f} {s['wall']:>7.1f} {floor_us:>6.1f} {100 * floor_us / untraced:>4.0f}% |"
          f" {s['py_eng']:>6.1f} {s['hand']:>5.1f} {s['group']:>5.1f} {s['acts']:>5.1f} {s['build']:>5.1f}"
          f" {s['first']:>5.1f} | {s['gemm']:>6.1f} {s['tail']:>5.1f} {s['close']:>5.1f} | {s['comb']:>5.1f}"
          f" {s['ret']:>5.1f} | {s['before']:>6.1f} {s['gemm'] - floor_us:>6.1f} {s['after']:>5.1f}")
    print(f"{'':<40} workers: late mean {s['late_mean']:.1f} max {s['late_max']:.1f} us, joined {s['joined']:.0f},"
          f" slept {s['slept']:.0f}; busy {pct(s['busy'])}% (least busy {pct(s['busy_min'])}%) wait"
          f" {pct(s['wait'])}% (most {pct(s['wait_max'])}%) idle {pct(s['idle'])}%; GB/s per core gu"
          f" {s['gu_gbps']:.1f} dn {s['dn_gbps']:.1f}; run {s['run_gbps']:.1f} GB/s; {s['items']:.0f} items;"
          f" in items (us, all workers): h->rows {s['convert']:.1f}, combine {s['comb_in_run']:.1f}")
    print(f"{'':<40} late by worker (us, median of the calls it joined; -: none): " +
          " ".join("-" if v != v else f"{v:.0f}" for v in lateness))
    print(f"{'':<40} GB/s by worker while computing (median of the calls it worked in): " +
          " ".join("-" if v != v else f"{v:.1f}" for v in worker_gbps), flush=True)


def add_arguments(ap):
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=SHAPES)
    ap.add_argument("--format", default="int4,int8,bf16")
    ap.add_argument("--tokens", default="1,4")
    ap.add_argument("--threads", default=None, help="comma list (default: every allowed CPU)")
    ap.add_argument("--modes", default="loop,sleep,flush")
    ap.add_argument("--api", default="forward", help="forward and/or submit (submit + wait)")
    for knob, default in DEFAULT_SCHEDULE.items():
        key, values = KNOBS[knob]
        ap.add_argument(f"--{knob.replace('_', '-')}", default=str(int(default)),
                        help=f"comma list of {values}; key suffix {key}N")
    ap.add_argument("--top-k", type=int, default=None, help="override K, the slots per token")
    ap.add_argument("--deferred", type=int, default=0,
                    help="each token's last D slots deferred (forward_deferred: one call, two outputs); default 0")
    ap.add_argument("--timeline", type=int, default=0,
                    help="print the item timeline of the first N traced calls per cell (default 0)")
    ap.add_argument("--pages", default="huge",
                    help="comma list: the layers' packed weights in huge pages (as the engine packs them) and/or "
                         "small (4 KiB pages: copies in torch's allocator); key suffix the name, if several")
    ap.add_argument("--variants", default=None,
                    help="instead of the knob lists: 'name=knob:value,...;name2=...' (knobs: EngineTuning's "
                         "fields, " + ", ".join(f.name for f in fields(EngineTuning)) + "; unset knobs keep their "
                         "defaults); key suffix name")
    ap.add_argument("--isa", default=None, choices=["generic", "avx2", "avx512", "amx"])
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--experts", type=int, default=None, help="override E (to fit a small machine)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--gap-us", type=float, default=100.0)
    ap.add_argument("--sleep-ms", type=float, default=5.0)
    ap.add_argument("--reps", type=int, default=6, help="cycles over the layers per cell (flush: 2 x reps calls)")


def run(args) -> int:
    shape = layer_shape(args.shape, args.experts, args.top_k)
    if not 0 <= args.deferred < shape["K"]:
        raise HybridMoEError(f"--deferred must be in [0, K), K = {shape['K']}")
    E, H, I, K = shape["E"], shape["H"], shape["I"], shape["K"]
    thread_counts = int_list(args.threads) if args.threads else [default_threads()]
    tokens = int_list(args.tokens)
    variants = schedule_variants(args)
    torch.set_num_threads(1)
    flush = cache_flusher("write")
    bw = {t: host_read_gbps(t) for t in thread_counts}
    for t in thread_counts:  # the same pool (and pinning) as the layers': worker w is worker w there
        rates = _native().read_bandwidth_by_worker(1 << 30, t, passes=3)
        print(f"# probe GB/s by worker, {t} threads at once: " + " ".join(f"{r / 1e9:.1f}" for r in rates) +
              f"; with the kernels' prefetches: {prefetching_read_gbps(t):.1f} GB/s in all", flush=True)
    gate, up, down = make_weights(E, H, I)
    print(f"# {args.shape}: E={E} H={H} I={I} top-{K}; host read GB/s " +
          ", ".join(f"{bw[t]:.1f} at {t} threads" for t in thread_counts) +
          f"; loop gap {args.gap_us:g} us, sleep {args.sleep_ms:g} ms, {args.layers} layers", flush=True)
    print(cell_header("fmt T thr mode api"))
    rows = []
    for fmt in str_list(args.format):
        t0 = time.perf_counter()
        first = CpuExperts(gate, up, down, format=fmt, group_size=args.group_size, threads=thread_counts[0],
                           isa=args.isa)
        state = first.packed_state()
        print(f"# {fmt}: packed in {time.perf_counter() - t0:.1f} s, isa {first.isa}", flush=True)
        block_bytes = matrix_block_bytes(first)
        per_expert = first.packed_bytes / E
        for pages, threads in itertools.product(str_list(args.pages), thread_counts):
            # huge: the packed layer itself (the engine's buffers, in huge pages) and copies like it
            copies = ([state] if pages == "huge" else []) + [packed_copy(state, huge=pages == "huge")
                                                             for _ in range(args.layers - (pages == "huge"))]
            layers = [CpuExperts.from_packed(c, threads=threads, isa=args.isa) for c in copies]
            page_key = f" {pages}" if "," in args.pages else ""
            time.sleep(0.05)  # the other thread count's pool goes to sleep
            for T in tokens:
                calls = [routing(T, H, E, K, seed=1000 * T + r) for r in range(N_ROUTINGS)]
                for mode in str_list(args.modes):
                    cell_layers = layers[:1] if mode == "flush" else layers
                    reps = 2 * args.reps if mode == "flush" else args.reps
                    for api, (suffix, tuning) in itertools.product(str_list(args.api), variants):
                        for layer in cell_layers:
                            layer.tune(tuning)
                        run = lambda traced: timed_calls(cell_layers, calls, api, mode, reps, args.gap_us * 1e-6,
                                                         args.sleep_ms * 1e-3, flush, traced, args.deferred)
                        untraced = med([(p1 - p0) / 1e3 for p0, p1, _ in run(False)])
                        stats = []
                        traced_calls = run(True)
                        for py0, py1, rec in traced_calls:
                            touched = len(set(rec["items"][:, EXPERT].tolist()))
                            stats.append(call_breakdown(rec, py0, py1, threads, block_bytes, touched * per_expert))
                        s = cell_medians(stats, threads)
                        lateness, worker_gbps = s.pop("late_by_worker"), s.pop("gbps_by_worker")
                        floor_us = s["bytes"] / (bw[threads] * 1e3)
                        key = f"{fmt} {T} {threads} {mode} {api}{suffix}{page_key}"
                        print_cell(key, len(stats), untraced, floor_us, s, lateness, worker_gbps)
                        deferral, deferral_calls = deferral_medians([rec for _, _, rec in traced_calls], block_bytes)
                        if deferral:
                            print_deferral(deferral, deferral_calls)
                        for _, _, rec in traced_calls[:args.timeline]:
                            print_timeline(rec)
                        rows.append(dict(shape=args.shape, format=fmt, tokens=T, threads=threads, mode=mode, api=api,
                                         schedule=asdict(tuning), pages=pages,
                                         calls=len(stats), untraced_us=untraced, floor_us=floor_us,
                                         host_read_gbps=bw[threads], late_by_worker_us=lateness,
                                         gbps_by_worker=worker_gbps, deferred=args.deferred, deferral=deferral,
                                         **s))
            del layers, copies
        del first, state
    write_json(args.json, {"shape": args.shape, "dims": shape, "rows": rows})
    return 0
