"""Why a hybrid decode layer's CPU work costs more in the pipeline than alone (issue #4): the same calls
traced twice in one process, once as the running decode makes them, once replayed standalone.

    python3 benchmarks/decode.py cpu-trace --synthetic qwen3-30b-a3b --layers 4 --format int4 \\
        --gpu-memory-budget 16GiB [--device cuda|cpu] [--calls 24] [--threads N] [--gap-us 100]
        [--torch-threads 0,1] [--deferred-experts K] [--timeline N] [--json F]

Builds a synthetic checkpoint in memory and loads it as `benchmarks/e2e.py` does (a cut model gets the GPU
experts per layer of the full depth under the budget), decodes greedily with the default engine path
(CUDA graphs and the CUDA handoff on CUDA), then decodes --calls more tokens with every CPU layer's
calls traced (moe_trace.h) and their inputs (x, ids, weights) captured:
  pipeline   on CUDA the handoff's own engine per layer (CudaHandoff.trace: the poller, pool worker 0,
             runs the layer; the inputs read back from the staging buffers after each step); on the
             CPU device (no graphs, no handoff) the layer's CpuExperts through submit/wait.
  standalone the same engines called from this thread with the captured inputs (on CUDA the handoff's
             run_on_host on its staging rows: the same engine, pool and padding as the poller's),
             layer after layer, --gap-us of busy work between calls, as `kernel.py trace`'s loop mode, traced.
With --torch-threads A,B the traced decode and its replay run once per value on the same engine (0: torch's
threads as loaded, as e2e runs; torch's own CPU threads may spin beside the expert pool's).
With --deferred-experts K (merged deferral: a layer's own and deferred slots in one call) each cell also
prints the deferred part: when the own output was ready (from the GEMM run's start), the call's time after
it, the deferred items' work before and after it, the workers that ran deferred items after it and the
deferred experts' bytes over that time.
Per layer and overall (all layers' calls together) it prints `kernel.py trace`'s cells (see its help for
the columns; here `untraced` is the median wall of the same calls untraced, and a pipeline call's wall
runs from the engine's call_ns to its end_ns, so py>eng and ret are 0; on the CPU device the pipeline
submits, so `hand` is the hand-off to the pool's driver thread), the distinct experts A, slots per token
K, the slots of weight 0 (padding that repeats an expert) and rows per expert, bytes read and the floor.
"""

from __future__ import annotations

import time

import torch

from hybridmoe.bench.anatomy import step_anatomy
from hybridmoe.bench.e2e import _measure
from hybridmoe.bench.suite import handoffs
from hybridmoe.bench.synthetic import full_config, synthetic_checkpoint
from hybridmoe.config import EngineConfig
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.cpu_experts import CpuExperts, _native, trace_records
from hybridmoe.sampling_params import SamplingParams
from hybridmoe.system.bandwidth import host_read_bandwidth, host_read_method

from .cli import options, write_json
from .common import busy_wait
from .e2e import _fmt, full_depth_gpu_experts
from .moe_trace import (call_breakdown, cell_header, cell_medians, deferral_medians, matrix_block_bytes, med,
                        print_cell, print_deferral, print_timeline)


def add_arguments(ap):
    ap.add_argument("--synthetic", default="qwen3-30b-a3b", metavar="PRESET", help="a make-model preset")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the synthetic model (default 4)")
    ap.add_argument("--format", default="int4", help="expert format (default int4)")
    ap.add_argument("--gpu-memory-budget", default=None)
    ap.add_argument("--gpu-experts-per-layer", type=int, default=None, help="instead of the budget's placement")
    ap.add_argument("--device", default="auto", help="cuda | cpu (default: the engine's choice)")
    ap.add_argument("--calls", type=int, default=24, help="traced decode steps (default 24)")
    ap.add_argument("--threads", type=int, default=None, help="CPU expert threads (default: the engine's)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=8192 + 32,
                    help="KV cache length, which the placement under a budget counts (default: e2e's default)")
    ap.add_argument("--torch-threads", type=lambda t: [int(v) for v in t.split(",")], default=[0],
                    help="comma list: torch's CPU threads for each traced round on the same engine (0: as loaded, "
                         "as e2e runs; default 0)")
    ap.add_argument("--deferred-experts", type=int, default=0, help="K lowest-scored experts deferred (default 0)")
    ap.add_argument("--timeline", type=int, default=0,
                    help="print the item timeline of each layer's first N pipeline calls (default 0)")
    ap.add_argument("--gap-us", type=float, default=100.0, help="standalone: busy work between calls")
    ap.add_argument("--group-size", type=int, default=None, help="expert group size (default: the engine's)")
    ap.add_argument("--bandwidth-bytes", type=int, default=1 << 30)
    ap.add_argument("--seed", type=int, default=0)


class Side:
    """One CPU layer: the engine the decode runs (on CUDA the handoff's, for its layer; else `cpu`), traced
    as the decode runs it and again in the standalone replay; `captured` the (x, ids, weights) of each
    traced pipeline call, `pipe_records` their trace records. `partner`: on CUDA with merged deferral, the
    handoff whose staging holds the layer's deferred slots (its ids and weights captured beside)."""

    def __init__(self, layer: int, cpu: CpuExperts, handoff, partner=None):
        self.layer, self.cpu, self.handoff, self.partner = layer, cpu, handoff, partner
        self.captured: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        # per captured call, its deferred slots: on CUDA (partner) their (ids, weights), else their count (0: none)
        self.captured_deferred: list = []
        self.pipe_records: list[dict] = []
        self.armed = False  # CPU device: the next submit is the traced one
        if handoff is not None:
            self.index, self.threads = handoff._index[layer], handoff.threads[layer]
        else:
            self.threads = cpu.threads

    def install(self) -> None:
        """A fresh round; on the CPU device, the layer's submit (or submit_deferred) records the inputs of each
        traced call."""
        self.captured, self.captured_deferred, self.pipe_records = [], [], []
        self.armed = False
        if self.handoff is None:
            submit, submit_deferred = self.cpu.submit, self.cpu.submit_deferred

            def keep(x, ids, weights, deferred):  # the traced call's inputs alone (not the prefill's, say)
                if self.armed:
                    self.armed = False
                    self.captured.append((x.clone(), ids.clone(), weights.clone()))
                    self.captured_deferred.append(deferred)

            def capture(x, ids, weights):
                keep(x, ids, weights, 0)
                return submit(x, ids, weights)

            def capture_deferred(x, ids, weights, deferred):
                keep(x, ids, weights, deferred)
                return submit_deferred(x, ids, weights, deferred)

            self.cpu.submit, self.cpu.submit_deferred = capture, capture_deferred

    def arm(self) -> None:
        if self.handoff is not None:
            self.handoff._native.trace(self.index, 1)
        else:
            self.armed = True
            self.cpu.trace(1)

    def take(self) -> list[dict]:
        if self.handoff is None:
            return self.cpu.take_trace()
        return trace_records(self.handoff._native.take_trace(self.index))

    def replay(self, step: int) -> tuple[int, int]:
        """Captured call `step` again, on this thread: on CUDA through the handoff's own engine on its staging
        rows (run_on_host, as the poller runs it: the fixed shapes' padding repeats a token's own expert,
        which CpuExperts.forward refuses; a merged layer with its deferred slots), else CpuExperts.forward.
        (start, end) in monotonic ns."""
        x, ids, weights = self.captured[step]
        if self.handoff is None:
            deferred = self.captured_deferred[step]
            py0 = time.monotonic_ns()
            if deferred:
                self.cpu.forward_deferred(x, ids, weights, deferred)
            else:
                self.cpu.forward(x, ids, weights)
            return py0, time.monotonic_ns()
        s, T = self.handoff._staging[self.layer], x.shape[0]
        s.x[:T].copy_(x)
        s.ids[:T].copy_(ids)
        s.weights[:T].copy_(weights)
        if self.partner is not None:  # the merged call reads the deferred slots from the partner's staging
            d, (d_ids, d_weights) = self.partner._staging[self.layer], self.captured_deferred[step]
            d.ids[:T].copy_(d_ids)
            d.weights[:T].copy_(d_weights)
        py0 = time.monotonic_ns()
        self.handoff.run_on_host([self.layer], T)
        return py0, time.monotonic_ns()

    def collect(self) -> None:
        """After a step: its record, and on the handoff its inputs from the staging buffers."""
        for rec in self.take():
            if self.handoff is not None:  # every slot of the staged rows, padding included
                s, T = self.handoff._staging[self.layer], rec["T"]
                self.captured.append((s.x[:T].clone(), s.ids[:T].clone(), s.weights[:T].clone()))
                if self.partner is not None:
                    d = self.partner._staging[self.layer]
                    self.captured_deferred.append((d.ids[:T].clone(), d.weights[:T].clone()))
            self.pipe_records.append(rec)

    def release(self) -> None:
        if self.handoff is None:
            self.cpu.__dict__.pop("submit", None)
            self.cpu.__dict__.pop("submit_deferred", None)


def engines(model) -> list[Side]:
    """The native CPU engine of each MoE layer: HybridExperts.cpu_engine, or (every expert on the CPU, no
    hybrid split) the native backend's layer_experts."""
    backend = model.experts
    engine_of = getattr(backend, "cpu_engine", None) or getattr(backend, "layer_experts", None)
    if engine_of is None:
        raise HybridMoEError(f"the model's expert backend ({type(backend).__name__}) has no CPU engines to trace")
    handoffs = getattr(backend, "_handoffs", {})
    merged = getattr(backend, "_merged", set())
    sides = []
    for layer in backend.layers():
        cpu = engine_of(layer)
        if isinstance(cpu, CpuExperts):
            partner = handoffs[(True, layer)][0] if layer in merged else None
            sides.append(Side(layer, cpu, handoffs.get((False, layer), (None, 0))[0], partner))
    if not sides:
        raise HybridMoEError("no MoE layer has native CPU experts (all on the GPU, or the torch reference)")
    return sides


def traced_decode(engine, sides: list[Side], prompt: list[int], calls: int) -> None:
    """Greedy decode of `calls` tokens, every CPU layer traced for one call per decode step."""
    engine.add_request(prompt, SamplingParams(max_tokens=calls + 1, temperature=0, ignore_eos=True))
    engine.step()  # the prefill: not traced
    while engine.has_unfinished():
        for s in sides:
            s.arm()
        engine.step()
        for s in sides:
            s.collect()


def standalone(sides: list[Side], gap_s: float, traced: bool) -> dict[int, list[tuple]]:
    """The captured calls again, step by step and layer after layer, gap_s of busy work before each;
    one warm-up round first. layer -> [(py0, py1, record or None)]."""
    out: dict[int, list[tuple]] = {s.layer: [] for s in sides}
    n = min(len(s.captured) for s in sides)
    for step in [0] + list(range(n)):
        for s in sides:
            busy_wait(gap_s)
            if traced:
                s.arm()
            py0, py1 = s.replay(step)
            rec = s.take()[0] if traced else None
            out[s.layer].append((py0, py1, rec))
    return {layer: calls[1:] for layer, calls in out.items()}  # the first: warm-up


def cell(side: Side, calls: list[tuple], inputs: list[tuple], bw_gbps: float) -> dict:
    """moe_trace's cell over calls [(py0, py1, record)], with the routing's shape from inputs."""
    per_expert = side.cpu.packed_bytes / side.cpu.num_experts
    block_bytes = matrix_block_bytes(side.cpu)
    stats = [call_breakdown(rec, py0, py1, side.threads, block_bytes, rec["A"] * per_expert)
             for py0, py1, rec in calls]
    s = cell_medians(stats, side.threads)
    s["floor"] = s["bytes"] / (bw_gbps * 1e3)
    s["A"] = med([rec["A"] for _, _, rec in calls])
    s["T"], s["K"] = med([ids.shape[0] for _, ids, _ in inputs]), med([ids.shape[1] for _, ids, _ in inputs])
    s["zero_slots"] = med([int((w == 0).sum()) for _, _, w in inputs])
    s["rows_per_expert"] = s["T"] * s["K"] / s["A"]
    s["calls"] = len(stats)
    s["slept_by_worker"] = [sum(bool(rec["slept"][w]) for _, _, rec in calls) for w in range(side.threads)]
    s["deferral"], s["deferral_calls"] = deferral_medians([rec for _, _, rec in calls], block_bytes)
    return s


def print_pair(key: str, side_cells: dict[str, dict], untraced: dict[str, float]) -> None:
    for name, s in side_cells.items():
        print_cell(f"{key} {name}", s["calls"], untraced[name], s["floor"], s, s["late_by_worker"], s["gbps_by_worker"])
        print(f"{'':<40} routing: T {s['T']:g}, K {s['K']:g} slots/token ({s['zero_slots']:g} of weight 0: "
              f"padding), A {s['A']:g} distinct experts, {s['rows_per_expert']:.2f} rows/expert; "
              f"read {s['bytes'] / 1e6:.2f} MB, floor {s['floor']:.1f} us, wall/floor {s['wall'] / s['floor']:.2f}")
        print(f"{'':<40} calls each worker had slept before: " + " ".join(map(str, s["slept_by_worker"])))
        if s["deferral"]:
            print_deferral(s["deferral"], s["deferral_calls"])
    p, q = side_cells["pipeline"], side_cells["standalone"]
    print(f"{'':<40} pipeline / standalone: wall {p['wall'] / q['wall']:.2f}x, gemm {p['gemm'] / q['gemm']:.2f}x, "
          f"before {p['before'] - q['before']:+.1f} us, tail {p['tail'] - q['tail']:+.1f} us, late mean "
          f"{p['late_mean'] - q['late_mean']:+.1f} us, busy {100 * (p['busy'] - q['busy']):+.1f} pts", flush=True)


def pipeline_calls(side: Side) -> list[tuple]:
    """(start, end, record): a pipeline call runs from call_ns (entry_ns where unset) to end_ns."""
    return [(rec["call_ns"] or rec["entry_ns"], rec["end_ns"], rec) for rec in side.pipe_records]


def run(args) -> int:
    if args.calls < 1:
        raise HybridMoEError(f"--calls must be at least 1, got {args.calls}")
    kwargs = dict(device=args.device, expert_format=args.format, max_num_seqs=1, cache_dir="",
                  deferred_experts=args.deferred_experts,
                  max_model_len=max(args.max_model_len, args.prompt_len + args.calls + 2))
    for key in ("gpu_memory_budget", "gpu_experts_per_layer", "group_size", "threads"):
        value = getattr(args, key)
        if value is not None:
            kwargs[{"group_size": "expert_group_size", "threads": "cpu_threads"}.get(key, key)] = value
    raw_full = full_config(args.synthetic)
    if args.gpu_memory_budget is not None and args.gpu_experts_per_layer is None \
            and args.layers < raw_full["num_hidden_layers"]:
        kwargs["gpu_experts_per_layer"], note = full_depth_gpu_experts(
            raw_full, {k: v for k, v in kwargs.items() if k != "cache_dir"})
        print(f"# {note}")
    with synthetic_checkpoint(args.synthetic, args.layers, seed=args.seed) as synthetic:
        engine = LLMEngine(str(synthetic.out_dir), EngineConfig.from_kwargs(**kwargs))
        try:
            return report(args, engine)
        finally:
            del engine


def report(args, engine) -> int:
    model = engine.runner.model
    sides = engines(model)
    cuda = any(s.handoff is not None for s in sides)
    threads = sides[0].threads
    bw = host_read_bandwidth(args.bandwidth_bytes, threads) / 1e9
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, engine.vocab_size, (args.prompt_len,), generator=g).tolist()
    _measure(engine, [prompt], args.calls + 1)  # warm-up: captures every graph the traced decode replays
    path = (f"CUDA graphs {'on' if engine.runner.cuda_graph else 'off'}, handoff {sides[0].handoff.path}, "
            f"{threads} pool workers" if cuda else
            f"device {engine.resolved_config.device}: no CUDA graph, no handoff (CpuExperts submit/wait from "
            f"Python), {threads} pool workers")
    gpu_experts = getattr(model.experts, "gpu_experts", lambda layer: [])
    print(f"# {args.synthetic}, {len(model.model.layers)} layers, {args.format}, {len(sides)} CPU layers ("
          f"GPU experts per layer: {'/'.join(str(len(gpu_experts(s.layer))) for s in sides)}); {path}; "
          f"host read {bw:.1f} GB/s ({host_read_method()}, {threads} threads); standalone: the captured calls "
          f"layer after layer, {args.gap_us:g} us gaps", flush=True)
    rounds = []
    for torch_threads in args.torch_threads:
        if torch_threads:
            torch.set_num_threads(torch_threads)
        rounds.append(trace_round(args, engine, sides, prompt, bw, torch_threads))
    write_json(args.json, {"args": options(args), "cuda": cuda, "threads": threads, "host_read_gbps": bw,
                            "rounds": rounds})
    return 0


def trace_round(args, engine, sides: list[Side], prompt: list[int], bw: float, torch_threads: int) -> dict:
    """An untraced decode (its handoff anatomy only), the traced decode and its standalone replay, printed;
    the cells for the JSON."""
    hs = handoffs(engine.runner.model)
    for h in hs:
        h.take_stats()
    plain = _measure(engine, [prompt], args.calls + 1)
    plain_anatomy = step_anatomy([h.take_stats() for h in hs], 1.0 / plain["decode_tok_s"])
    for s in sides:
        s.install()
    t0 = time.perf_counter()
    try:
        traced_decode(engine, sides, prompt, args.calls)
    finally:
        for s in sides:
            s.release()
    decode_s = time.perf_counter() - t0
    anatomy = step_anatomy([h.take_stats() for h in hs], decode_s / (args.calls + 1))
    napping = [_native().flag_poller_napping()] if hs else []
    print(f"\n## torch CPU threads {torch.get_num_threads()} ({'set' if torch_threads else 'as loaded'}): "
          f"untraced decode {plain['decode_tok_s']:.1f} tok/s; {args.calls} traced decode steps in "
          f"{decode_s * 1e3:.1f} ms")
    for name, a in (("untraced decode just before", plain_anatomy), ("traced decode", anatomy)):
        if a is not None:  # the poller's own books over the steps (hybridmoe/bench/anatomy.py)
            print(f"# handoff anatomy, {name}: {a.layers_per_step:.0f} CPU layers/step, CPU {a.cpu_us:.1f} "
                  f"us/layer (first layer {a.first_cpu_us:.1f}), gap {_fmt(a.gap_us)} us, go late "
                  f"{a.late_us:.2f} us, step {a.step_us:.0f} us" + (" (tracing between steps included)"
                                                                      if a is anatomy else ""))
    print(cell_header("layer side"))
    untraced = {s.layer: [(p1 - p0) / 1e3 for p0, p1, _ in calls]
                for s, calls in zip(sides, standalone(sides, args.gap_us * 1e-6, False).values())}
    solo = standalone(sides, args.gap_us * 1e-6, True)
    if napping:
        napping.append(_native().flag_poller_napping())
        print(f"# the handoff's flag poller napping: before the replay {napping[0]}, after it {napping[1]}")
    layers, both = [], {"pipeline": ([], []), "standalone": ([], [])}  # side -> (calls, inputs) of all layers
    for s in sides:
        pipe = pipeline_calls(s)
        n = min(len(pipe), len(solo[s.layer]))
        calls = {"pipeline": pipe[:n], "standalone": solo[s.layer][:n]}
        cells = {name: cell(s, c, s.captured[:n], bw) for name, c in calls.items()}
        print_pair(f"layer {s.layer}", cells, {"pipeline": cells["pipeline"]["wall"],
                                               "standalone": med(untraced[s.layer])})
        for _, _, rec in calls["pipeline"][:args.timeline]:
            print_timeline(rec)
        for name, c in calls.items():
            both[name][0].extend(c)
            both[name][1].extend(s.captured[:n])
        layers.append({"layer": s.layer, **cells})
    overall = {name: cell(sides[0], c, inputs, bw) for name, (c, inputs) in both.items()}  # layers alike
    print_pair("all layers", overall, {"pipeline": overall["pipeline"]["wall"],
                                       "standalone": med([v for vs in untraced.values() for v in vs])})
    return {"torch_threads": torch.get_num_threads(), "anatomy": anatomy.to_json() if anatomy else None,
            "untraced_anatomy": plain_anatomy.to_json() if plain_anatomy else None,
            "untraced_decode_tok_s": plain["decode_tok_s"],
            "layers": layers, "overall": overall}

