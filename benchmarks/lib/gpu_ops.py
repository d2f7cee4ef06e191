"""GPU kernels per decoder layer of one decode step, their GPU time, and the captured step's replay time.

    python3 benchmarks/decode.py gpu-ops [--synthetic PRESET] [--layers N] [--format int4]
        [--gpu-experts-per-layer G] [--batch B] [--context C] [--reps R] [--paths unfused,fused,layer] [--json F]

Loads a random-weight checkpoint of PRESET cut to N layers (written to /dev/shm, as e2e.py does), prefills
one prompt of C tokens (--context, default 16: where a long context's decode step spends its time shows
beside a short one's) per batch row and decodes one token through the engine (so the decode step's buffers hold a real
step), then, on the decode step the engine runs (fixed shapes on CUDA, the model's eager forward elsewhere),
for each path (fused: RMSNorm with its residual add, attention's q/k norms + rotary + cache writes, the
router's top-k, the hybrid split and sum as one Triton kernel each, MoECausalLM.fuse_decode_kernels;
layer: fused, and the fusions across a layer's ops: its linear layers as the Triton decode GEMV, qkv_proj
and the router each with the norm before it (layers/gemv_triton.py), q/k norms + rotary + cache writes
inside decode attention, MLA's decode in one kernel (layer fusions: fused_layer, on by default), the
handoff's rows and flags on their own kernel and stream memory operations and the residual added after
the MoE; kflags: layer, and the CUDA handoff's rows staged and its flags played by the router's and the
sum's kernels (HybridTuning.kernel_flags), the residual added in the MoE's last kernel
(SparseMoeBlock.adds_residual): the engine's default; unfused: the torch ops they replace):
  - profiles one eager step: per decoder layer the GPU kernels, copies and memsets it launches and their
    GPU time (torch profiler; a launch belongs to the layer whose forward was running on the host), the
    last MoE layer's kernels by name, and its top-level torch ops (on the CPU, the only column);
  - on CUDA, captures the step as a CUDA graph: its nodes by type, the GPU activities one profiled replay
    shows, and the replay time (the least of 3 medians of R replays, the paths interleaved; per layer:
    that time / N, lm_head's share included); then the time each later path saves per layer against the
    first one given (before -> after).
A MoE layer's GPU part is serial with its CPU part. Each replay is also printed activity by activity
with the idle time before each (launch and drain inside the graph, or the wait for the CPU experts).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import os
import tempfile
import time
import traceback

import torch

from hybridmoe.bench.synthetic import synthetic_checkpoint
from hybridmoe.config import EngineConfig
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.engine.model_runner import MIN_PAD_LEN
from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.hybrid import HybridExperts
from hybridmoe.forward_context import Context, DecodeBatch, use_context
from hybridmoe.sampling_params import SamplingParams

from .cli import str_list, write_json
from .common import capture_graph, replay_us

PROMPT_LEN = 16
PATHS = ("unfused", "fused", "layer", "kflags")
CPU_WAIT_US = 15.0
"""An idle GPU gap at least this long in a replay is a wait for the CPU experts (launch gaps are ~1-4 us)."""
GPU_KINDS = ("kernel", "gpu_memcpy", "gpu_memset")
GRAPH_NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "child graph", 5: "empty",
                    6: "wait event", 7: "event record", 10: "mem alloc", 11: "mem free", 12: "stream mem op"}
"""CUgraphNodeType values."""


def add_arguments(parser):
    cuda = torch.cuda.is_available()
    parser.add_argument("--synthetic", default="qwen3-30b-a3b" if cuda else "qwen3_moe:tiny",
                        help="make-model preset (default: qwen3-30b-a3b on CUDA, qwen3_moe:tiny on the CPU)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    parser.add_argument("--format", default="int4" if cuda else "bf16", help="expert format (default int4; CPU: bf16)")
    parser.add_argument("--gpu-experts-per-layer", type=int, default=26 if cuda else 0,
                        help="routed experts per layer on the GPU (default 26: Qwen3-30B-A3B under 16 GiB; CPU: 0)")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together (default 1)")
    parser.add_argument("--context", type=int, default=PROMPT_LEN,
                        help=f"tokens of each row's prompt before the profiled step (default {PROMPT_LEN})")
    parser.add_argument("--reps", type=int, default=200, help="graph replays timed (default 200)")
    parser.add_argument("--paths", default="unfused,fused,layer",
                        help="unfused (torch), fused (Triton kernels for norms, rotary, router, hybrid split and "
                             "sum), layer (fused + the decode GEMV with the norms folded in, rotary inside attention), "
                             "kflags (layer + the handoff's flags in kernels, HybridTuning.kernel_flags, and the "
                             "residual added in the MoE's last kernel), "
                             "comma-separated, measured side by side, each against the first "
                             "(default unfused,fused,layer)")


class LayerMarks:
    """A profiler range "layer i" around each decoder layer's forward (forward hooks)."""

    def __init__(self, layers: torch.nn.ModuleList):
        self.open: list = []
        self.handles = []
        for i, layer in enumerate(layers):
            self.handles.append(layer.register_forward_pre_hook(self._enter(i)))
            self.handles.append(layer.register_forward_hook(self._exit))

    def _enter(self, i: int):
        def hook(module, args):
            rf = torch.profiler.record_function(f"layer {i}")
            rf.__enter__()
            self.open.append(rf)
        return hook

    def _exit(self, module, args, out):
        self.open.pop().__exit__(None, None, None)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def profile_step(step, model, cuda: bool) -> dict:
    """One call of step() under the profiler -> per "layer i": counts of kernel, gpu_memcpy, gpu_memset and
    top-level cpu_ops, gpu_us, and Counters names / name_us (GPU activities) and ops (top-level CPU ops)."""
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    marks = LayerMarks(model.model.layers)
    try:
        with torch.profiler.profile(activities=activities) as prof:
            step()
            if cuda:
                torch.cuda.synchronize()
    finally:
        marks.remove()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return per_layer(events)


def per_layer(events: list[dict]) -> dict:
    """Chrome-trace events -> per "layer i" range: GPU activities launched inside it (by the launching
    runtime call's correlation id and host time) and CPU ops inside it."""
    ranges = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                    if e.get("cat") == "user_annotation" and e.get("name", "").startswith("layer "))

    def layer_at(ts: float) -> str | None:
        for start, end, name in ranges:
            if start <= ts <= end:
                return name
        return None

    launch_ts = {e["args"]["correlation"]: e["ts"] for e in events
                 if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    out = {name: {"kernel": 0, "gpu_memcpy": 0, "gpu_memset": 0, "gpu_us": 0.0, "cpu_ops": 0,
                  "names": collections.Counter(), "name_us": collections.Counter(),
                  "ops": collections.Counter()} for _, _, name in ranges}
    for e in events:
        cat = e.get("cat")
        if cat in GPU_KINDS:
            layer = layer_at(launch_ts.get(e.get("args", {}).get("correlation"), -1.0))
            if layer is None:
                continue
            row = out[layer]
            row[cat] += 1
            row["gpu_us"] += e.get("dur", 0.0)
            row["names"][e["name"][:60]] += 1
            row["name_us"][e["name"][:60]] += e.get("dur", 0.0)
    # top-level ops only: an op inside another (aten::linear -> aten::addmm) is part of it
    reach = -1.0
    for e in sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] < reach:
            continue
        reach = e["ts"] + e["dur"]
        layer = layer_at(e["ts"])
        if layer is not None:
            out[layer]["cpu_ops"] += 1
            out[layer]["ops"][e["name"]] += 1
    return out


def graph_node_types(graph: torch.cuda.CUDAGraph) -> dict[str, int] | str:
    """The captured graph's nodes by type, or why not. Through the driver API (libcuda): the runtime's
    cudaGraphNodeGetType fails on stream-memory-op nodes and leaves that error for torch's next
    launch check to raise."""
    try:
        drv = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return f"no libcuda ({e})"
    handle = ctypes.c_void_p(graph.raw_cuda_graph())
    n = ctypes.c_size_t(0)
    if drv.cuGraphGetNodes(handle, None, ctypes.byref(n)) != 0:
        return "cuGraphGetNodes failed"
    nodes = (ctypes.c_void_p * n.value)()
    drv.cuGraphGetNodes(handle, nodes, ctypes.byref(n))
    counts: collections.Counter = collections.Counter()
    for node in nodes:
        kind = ctypes.c_int(-1)
        drv.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind))
        counts[GRAPH_NODE_TYPES.get(kind.value, f"type {kind.value}")] += 1
    return dict(counts)


def profile_replay(graph: torch.cuda.CUDAGraph) -> dict:
    """One replay under the profiler: the GPU activities it shows by kind, their summed GPU time, its span
    (first start to last end), and the timeline: (start us from the first, GPU us, idle us before it, name)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = sorted((e for e in json.load(f)["traceEvents"] if e.get("cat") in GPU_KINDS),
                            key=lambda e: e["ts"])
    counts = collections.Counter(e["cat"] for e in events)
    timeline, end = [], events[0]["ts"] if events else 0.0
    for e in events:
        dur = e.get("dur", 0.0)
        timeline.append((e["ts"] - events[0]["ts"], dur, max(0.0, e["ts"] - end), e["name"][:70]))
        end = max(end, e["ts"] + dur)
    span = end - events[0]["ts"] if events else 0.0
    return {**counts, "gpu_us": sum(e.get("dur", 0.0) for e in events), "span_us": span, "timeline": timeline}


def print_timeline(path: str, replay: dict) -> None:
    """The profiled replay kernel by kernel: where the GPU is busy, and the idle time before each activity
    (launch and drain inside the graph, or, before the first kernel after a handoff wait, the CPU experts)."""
    print(f"\n{path}: one profiled replay, activity by activity (us)")
    print(f"{'start':>8} {'GPU':>6} {'idle':>6}  name")
    for start, dur, idle, name in replay["timeline"]:
        print(f"{start:8.1f} {dur:6.1f} {idle:6.1f}  {name}")
    idle = [i for _, _, i, _ in replay["timeline"]]
    waits = [i for i in idle if i >= CPU_WAIT_US]
    print(f"  span {replay['span_us']:.1f} us = busy {replay['gpu_us']:.1f} + idle {sum(idle):.1f}: "
          f"{len(waits)} waits of >= {CPU_WAIT_US:.0f} us (the CPU experts) {sum(waits):.1f} + "
          f"{len(idle) - len(waits)} shorter (launch and drain) {sum(idle) - sum(waits):.1f}; "
          f"GPU-side time (span - waits) {replay['span_us'] - sum(waits):.1f} us")


def decode_thread(model):
    """The engine's context for a decode step's thread (pinned off the CPU pools' CPUs), or none."""
    pin = getattr(model.experts, "decode_thread", None)
    return pin() if pin is not None else contextlib.nullcontext()


def use_path(model, path: str) -> None:
    """Switch the model's decode kernels to one of PATHS."""
    model.fuse_decode_kernels(path != "unfused", layer=path in ("layer", "kflags"))
    if isinstance(model.experts, HybridExperts):
        model.experts.tuning.kernel_flags = path == "kflags"
    for layer in model.model.layers:
        mlp = getattr(layer, layer.mlp_name)
        if hasattr(mlp, "adds_residual"):
            mlp.adds_residual = path == "kflags"


def decode_step(engine: LLMEngine, seqs: list, cuda_fixed: bool):
    """The decode step the engine just ran for seqs (their last token again), as a callable."""
    runner, model = engine.runner, engine.runner.model
    lens = [s.num_computed for s in seqs]  # the last decoded token sits at lens - 1
    if cuda_fixed:
        pad_len = max(MIN_PAD_LEN, 1 << (max(lens) - 1).bit_length())
        # the runner's static buffers still hold this step's rows (batch <= SMALL_BATCHES: no padding rows)
        ctx = Context(slot_ids=[], start_pos=[], cu_seqlens=[0],
                      decode=DecodeBatch(runner._slots[:len(seqs)], runner._lens[:len(seqs)], pad_len),
                      block_table=runner.block_table)
        ids, positions = runner._ids[:len(seqs)], runner._positions[:len(seqs)]
    else:
        ctx = Context(slot_ids=[s.slot for s in seqs], start_pos=[n - 1 for n in lens],
                      cu_seqlens=list(range(len(seqs) + 1)), block_table=runner.block_table)
        ids = torch.tensor([s.token_ids(n - 1, n)[0] for s, n in zip(seqs, lens)], device=runner.device)
        positions = torch.tensor([n - 1 for n in lens], device=runner.device)

    @torch.inference_mode()
    def step():
        with use_context(ctx):
            return model.compute_logits(model(ids, positions))
    return step


def print_profile(title: str, prof: dict, moe_layers: list[int]) -> None:
    print(f"\n{title}: per decoder layer (eager step, torch profiler)")
    print(f"{'layer':>8} {'kernels':>8} {'memcpy':>7} {'memset':>7} {'GPU us':>8} {'cpu ops':>8}")
    for name, row in prof.items():
        print(f"{name:>8} {row['kernel']:>8} {row['gpu_memcpy']:>7} {row['gpu_memset']:>7} "
              f"{row['gpu_us']:>8.1f} {row['cpu_ops']:>8}")
    last = f"layer {moe_layers[-1]}" if moe_layers else None
    if last in prof:
        print(f"  {last}, GPU activities by name (count, GPU us):")
        for name, n in prof[last]["names"].most_common():
            print(f"    {n:>3} {prof[last]['name_us'][name]:>8.1f}  {name}")
        print(f"  {last}, top-level ops: " + ", ".join(f"{n} {op}" for op, n in prof[last]["ops"].most_common()))


def run(args) -> int:
    paths = str_list(args.paths)
    if not paths or any(p not in PATHS for p in paths):
        raise HybridMoEError(f"--paths takes {', '.join(PATHS)}, got {args.paths!r}")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    t0 = time.perf_counter()
    with synthetic_checkpoint(args.synthetic, args.layers) as ckpt:
        config = EngineConfig.from_kwargs(
            device=device.type, expert_format=args.format, gpu_experts_per_layer=args.gpu_experts_per_layer,
            max_num_seqs=args.batch, max_model_len=max(256, args.context + 16), cache_dir="",
            prefill_streaming="off")
        engine = LLMEngine(ckpt.out_dir, config)
    use_path(engine.runner.model, paths[0])  # the engine's own steps on the first path (a failing later one
    # then loses only its own rows)
    print(f"{args.synthetic}, {args.layers} layers, {args.format} experts, {args.gpu_experts_per_layer} GPU experts "
          f"per layer, batch {args.batch}, context {args.context}, device {device}; loaded in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    if args.context < 1:
        raise HybridMoEError(f"--context is at least 1, got {args.context}")
    for b in range(args.batch):
        engine.add_request([(7 * b + i) % engine.vocab_size for i in range(args.context)],
                           SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    while not any(s.output_ids for s in engine._requests.values()):
        engine.step()  # the prompts, in as many chunks as the engine cuts them into
    engine.step()  # one decode step: on CUDA fixed shapes (and its graph captured)
    seqs = list(engine._requests.values())
    model = engine.runner.model
    moe_layers = list(model.moe_layers)
    cuda_fixed = cuda and engine.runner.fixed
    print(f"decode step in fixed shapes: {cuda_fixed}; MoE layers {moe_layers}", flush=True)
    step = decode_step(engine, seqs, cuda_fixed)
    result: dict = {"preset": args.synthetic, "layers": args.layers, "format": args.format,
                    "gpu_experts_per_layer": args.gpu_experts_per_layer, "batch": args.batch, "context": args.context,
                    "device": str(device), "fixed_shapes": cuda_fixed, "paths": {}}
    graphs = {}
    for path in paths:
        use_path(model, path)
        try:
            step()  # warm-up (Triton compiles here)
            prof = profile_step(step, model, cuda)
            print_profile(path, prof, moe_layers)
            result["paths"][path] = {"profile": prof}
            if cuda_fixed:
                graphs[path] = capture_graph(step, keep_graph=True)
                result["paths"][path]["graph_nodes"] = graph_node_types(graphs[path])
                with decode_thread(model):
                    replay = profile_replay(graphs[path])
                print_timeline(path, replay)
                result["paths"][path]["replay_profile"] = replay
        except Exception:  # noqa: BLE001 (one path's failure must not lose the other's rows)
            traceback.print_exc()
            print(f"{path}: FAILED", flush=True)
            result["paths"].pop(path, None)
            graphs.pop(path, None)
    if graphs:
        us = {path: [] for path in graphs}
        with decode_thread(model):  # pinned off the CPU pools' CPUs, as the engine's own steps run
            for _ in range(3):  # interleaved, so that every path sees the same machine state
                for path, graph in graphs.items():
                    us[path].append(replay_us(graph, args.reps))
        print(f"\ncaptured step, replay time: the least of 3 medians of {args.reps} replays")
        for path in graphs:
            r = result["paths"][path]
            r["replay_us"] = min(us[path])
            print(f"  {path:>8}: {r['replay_us']:8.1f} us = {r['replay_us'] / args.layers:6.1f} us per layer; "
                  f"nodes {r['graph_nodes']}; one profiled replay: "
                  f"{ {k: v for k, v in r['replay_profile'].items() if k != 'timeline'} }")
    done = list(result["paths"])
    if len(done) >= 2 and moe_layers:
        last = f"layer {moe_layers[-1]}"
        a = result["paths"][done[0]]
        for path in done[1:]:
            b = result["paths"][path]
            line = (f"\n{done[0]} -> {path}, last MoE layer: kernels {a['profile'][last]['kernel']} -> "
                    f"{b['profile'][last]['kernel']}, top-level ops {a['profile'][last]['cpu_ops']} -> "
                    f"{b['profile'][last]['cpu_ops']}")
            if done[0] in graphs and path in graphs:
                saved = a["replay_us"] - b["replay_us"]
                line += (f"; replay {a['replay_us']:.1f} -> {b['replay_us']:.1f} us "
                         f"({a['replay_us'] / b['replay_us']:.3f}x), {saved / args.layers:.1f} us saved per layer")
            print(line)
    write_json(args.json, result)
    return 0
