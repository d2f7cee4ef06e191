"""Per-layer cost of ordering CPU expert work on a CUDA stream: our two native paths vs Python.

A decode step of L layers (default 48); each layer copies hidden [T, H], topk_ids [T, K] and
topk_weights [T, K] to pinned staging buffers (D2H), runs a toy CPU step (a small CpuExperts
layer), copies its output back (H2D) and adds it on the GPU. Variants, all in this process:

  gpu_only         the copies and the add, no CPU step (CUDA graph): the floor
  memops           CudaHandoff(path="stream_mem_ops").enqueue (the rows and the output through copies,
                   like gpu_only's): go word written by the stream,
                   our polling thread runs the layer, the stream waits for the done word (graph)
  memops_split     the same with enqueue_submit + enqueue_wait (graph)
  memops_zero_copy memops with zero-copy staging: one kernel writes the rows through the device's
                   mapping of the pinned buffers, the add reads the output there (no copies; graph)
  memops_eager     memops launched from Python every step (no graph)
  memops_blocking  memops, timed while this thread sleeps in its wait for the GPU (a blocking
                   event) instead of spinning: with as many workers as CPUs, the core it frees
  native           CudaHandoff(path="host_function").enqueue: one native host function per layer (graph)
  native_split     enqueue_submit + enqueue_wait: two native host functions per layer (graph)
  native_eager     native launched from Python every step (no graph)
  python_callback  a Python host function (ctypes; takes the GIL) running CpuExperts.forward (graph)
  python_sync      Python synchronizes the stream, runs CpuExperts.forward, copies back (no graph)
  cpu_step         the native CPU step alone as host functions run it: the L layers in a row
                   without CUDA, submit + wait on the pool's driver thread (run_on_host)
  cpu_step_here    the same as the polling thread runs it: on the calling thread (run_on_host of
                   the stream_mem_ops handoff)

handoff µs/layer = (variant - gpu_only) / L - cpu_step / L (cpu_step_here for memops*): what
ordering the CPU work on the stream costs beyond the copies and the CPU work itself. Target for
the native handoff: <= 10 µs. For memops* the polling thread also times the CPU work inside the
running pipeline; "in pipeline" subtracts that instead of the separately timed CPU step (the
CPU work can run slower or faster between GPU work than back to back).

    python3 benchmarks/kernel.py handoff --layers 48 --tokens 1,4 --json out/handoff.json
    python3 benchmarks/kernel.py handoff --threads 16,15 --variants gpu_only,cpu_step,cpu_step_here,memops,native

The timing thread runs pinned off the handoff pool's CPUs, as a decode step's does (--no-pin: unpinned).
"""

from __future__ import annotations

import ctypes
import os

import torch

from hybridmoe.experts.cpu_experts import CpuExperts
from hybridmoe.experts.cuda_handoff import CudaHandoff, pinned

from .cli import int_list, str_list, write_json
from .common import capture_graph, seconds_per_call

TARGET_US = 10.0
HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def add_arguments(p):
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--tokens", default="1,4", help="comma-separated T values")
    p.add_argument("--hidden", type=int, default=2048, help="H (Qwen3-30B-A3B: 2048)")
    p.add_argument("--experts", type=int, default=8, help="E of the toy CPU step")
    p.add_argument("--intermediate", type=int, default=32, help="I of the toy CPU step")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--threads", default="4", help="CPU expert workers of the toy step (comma-separated: one "
                   "table each; as many as the CPUs shows what a pool that leaves none free costs)")
    p.add_argument("--variants", help="comma-separated variants to run (default: all)")
    p.add_argument("--reps", type=int, default=100, help="steps per timed trial")
    p.add_argument("--trials", type=int, default=5, help="timed trials (the median is reported)")
    p.add_argument("--no-pin", action="store_true", help="time with this thread where the scheduler puts it, "
                   "instead of pinned off the handoff pool's CPUs (as a decode step runs: HybridExperts.decode_thread)")


def graphed(step, *inputs):
    """step captured in a CUDA graph; returns graph.replay."""
    return capture_graph(lambda: step(*inputs)).replay


class Baselines:
    """The copies the handoff makes, through this benchmark's own pinned buffers, with the CPU
    step left out (gpu_only) or done in Python (python_callback, python_sync)."""

    def __init__(self, experts: CpuExperts, layers: int, tmax: int, H: int, K: int, cudart: str):
        self.experts, self.layers = experts, layers
        self.buf = [dict(x=torch.zeros(tmax, H, dtype=torch.bfloat16, pin_memory=True),
                         ids=torch.zeros(tmax, K, dtype=torch.int64, pin_memory=True),
                         w=torch.zeros(tmax, K, pin_memory=True),
                         out=torch.zeros(tmax, H, dtype=torch.bfloat16, pin_memory=True)) for _ in range(layers)]
        self.rt = ctypes.CDLL(cudart)
        self.rt.cudaLaunchHostFunc.argtypes = [ctypes.c_void_p, HOST_FN, ctypes.c_void_p]
        self.rt.cudaLaunchHostFunc.restype = ctypes.c_int
        self.callbacks: dict[tuple[int, int], HOST_FN] = {}  # kept alive: graphs call them

    def _d2h(self, b, x, ids, w):
        T = x.shape[0]
        b["x"][:T].copy_(x, non_blocking=True)
        b["ids"][:T].copy_(ids, non_blocking=True)
        b["w"][:T].copy_(w, non_blocking=True)

    def _cpu(self, b, T):
        b["out"][:T].copy_(self.experts.forward(b["x"][:T], b["ids"][:T], b["w"][:T]))

    def gpu_only(self, x, ids, w):
        for b in self.buf:
            self._d2h(b, x, ids, w)
            x = x + b["out"][:x.shape[0]].to(x.device, non_blocking=True)
        return x

    def python_callback(self, x, ids, w):
        T = x.shape[0]
        for layer, b in enumerate(self.buf):
            self._d2h(b, x, ids, w)
            key = (layer, T)
            if key not in self.callbacks:
                self.callbacks[key] = HOST_FN(lambda _, b=b: self._cpu(b, T))
            err = self.rt.cudaLaunchHostFunc(torch.cuda.current_stream().cuda_stream, self.callbacks[key], None)
            if err:
                raise RuntimeError(f"cudaLaunchHostFunc failed with error {err}")
            x = x + b["out"][:T].to(x.device, non_blocking=True)
        return x

    def python_sync(self, x, ids, w):
        T = x.shape[0]
        for b in self.buf:
            self._d2h(b, x, ids, w)
            torch.cuda.current_stream().synchronize()
            self._cpu(b, T)
            x = x + b["out"][:T].to(x.device, non_blocking=True)
        return x


def run(args) -> int:
    tokens = int_list(args.tokens)
    threads = int_list(args.threads)
    wanted = set(str_list(args.variants)) if args.variants else None
    E, H, I, K, L = args.experts, args.hidden, args.intermediate, args.top_k, args.layers
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cpus": len(os.sched_getaffinity(0)), "layers": L, "H": H, "E": E, "I": I, "K": K,
            "reps": args.reps, "trials": args.trials}
    rows = []
    for n in threads:
        g = torch.Generator().manual_seed(0)
        experts = CpuExperts(torch.randn(E, I, H, generator=g) / H**0.5, torch.randn(E, I, H, generator=g) / H**0.5,
                             torch.randn(E, H, I, generator=g) / I**0.5, format="bf16", threads=n)
        # One toy layer behind every handoff layer: the CPU step stays small and cached.
        handoff = CudaHandoff([experts] * L, max_tokens=max(tokens), top_k=K, path="host_function")
        try:
            memops, memops_error = CudaHandoff([experts] * L, max_tokens=max(tokens), top_k=K,
                                               path="stream_mem_ops"), None
        except Exception as e:  # reported in the table, the other variants still run
            memops, memops_error = None, f"{type(e).__name__}: {e}"
        timed_cpus = set() if args.no_pin else (memops or handoff).driver_cpus  # the timing thread's (pinned)
        info.update(cudart=handoff.runtime, isa=experts.isa, memops_path=memops.path if memops else memops_error)
        print(f"{info['gpu']}, torch {info['torch']}, cudart {info['cudart']}, {info['cpus']} CPUs, "
              f"isa {info['isa']}; {L} layers, H={H}, toy CPU step E={E} I={I} K={K} on {n} threads "
              f"({handoff.threads[0]} in the handoff's pool; timed "
              f"{'unpinned' if args.no_pin else f'on CPUs {sorted(timed_cpus)}'}); "
              f"stream_mem_ops: {info['memops_path']}")
        print(f"{'T':>3} {'variant':<16} {'us/step':>10} {'us/layer':>9} {'handoff us/layer':>17}", flush=True)
        base = Baselines(experts, L, max(tokens), H, K, handoff.runtime)
        for T in tokens:
            x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).cuda()
            w = torch.softmax(torch.randn(T, K, generator=g), dim=-1).cuda()
            runs = variants(L, T, x, ids, w, base, handoff, memops, memops_error)
            times = {}
            for name, (make, blocking) in runs.items():
                if wanted is not None and name not in wanted:
                    continue
                row = {"threads": n, "T": T, "variant": name}
                try:
                    step = make()
                    if memops is not None:
                        memops.take_stats()
                    with pinned(timed_cpus):
                        t = times[name] = seconds_per_call(step, args.reps, args.trials, 10, blocking)
                    stats = memops.take_stats() if memops is not None else None
                    if name.startswith("memops") and stats and stats["layers"] and "gpu_only" in times:
                        # the CPU work's time as the polling thread measured it, inside this pipeline
                        row["cpu_us_per_layer_in_pipeline"] = cpu = stats["cpu_us"] / stats["layers"]
                        row["handoff_us_per_layer_in_pipeline"] = (t - times["gpu_only"]) * 1e6 / L - cpu
                    for h in (handoff, memops):
                        if h is not None:
                            h.check()
                    row.update(us_per_step=t * 1e6, us_per_layer=t * 1e6 / L)
                    cpu = "cpu_step_here" if name.startswith("memops") else "cpu_step"
                    if not name.startswith(("gpu_only", "cpu_step")) and "gpu_only" in times and cpu in times:
                        row["handoff_us_per_layer"] = (t - times["gpu_only"] - times[cpu]) * 1e6 / L
                except Exception as e:  # one variant failing must not hide the others' numbers
                    row["error"] = f"{type(e).__name__}: {e}"
                rows.append(row)
                print_row(row)
                write_json(args.json, {"info": info, "rows": rows})  # after every row: a hang keeps the rest
        del handoff, memops, base
        torch.cuda.synchronize()
    return 0


def variants(L, T, x, ids, w, base, handoff, memops, memops_error) -> dict:
    """name -> (make: () -> the step to time, blocking: whether the timer sleeps in its waits)."""

    def chain(h):
        def step(x, ids, w):
            for layer in range(L):
                x = x + h.enqueue(None, layer, x, ids, w)
            return x
        return step

    def chain_split(h):
        def step(x, ids, w):
            for layer in range(L):
                h.enqueue_submit(None, layer, x, ids, w)
                x = x + h.enqueue_wait(None, layer)
            return x
        return step

    def cpu_step(h):
        chain(h)(x, ids, w)  # stage real inputs for the CPU work to run on
        torch.cuda.synchronize()
        return lambda: h.run_on_host(range(L), T)

    def zero_copy(make):
        memops.zero_copy = True
        try:
            return make()  # captured with zero-copy staging; the flag only matters while enqueueing
        finally:
            memops.zero_copy = False

    def needs_memops(make):
        def checked():
            if memops is None:
                raise RuntimeError(memops_error)
            return make()
        return checked

    # The Python host callback last: if it stalls, the native figures are already out.
    return {
        "gpu_only": (lambda: graphed(base.gpu_only, x, ids, w), False),
        "cpu_step": (lambda: cpu_step(handoff), False),
        "cpu_step_here": (needs_memops(lambda: cpu_step(memops)), False),
        "memops": (needs_memops(lambda: graphed(chain(memops), x, ids, w)), False),
        "memops_blocking": (needs_memops(lambda: graphed(chain(memops), x, ids, w)), True),
        "memops_split": (needs_memops(lambda: graphed(chain_split(memops), x, ids, w)), False),
        "memops_zero_copy": (needs_memops(lambda: zero_copy(lambda: graphed(chain(memops), x, ids, w))), False),
        "memops_eager": (needs_memops(lambda: (lambda: chain(memops)(x, ids, w))), False),
        "native": (lambda: graphed(chain(handoff), x, ids, w), False),
        "native_split": (lambda: graphed(chain_split(handoff), x, ids, w), False),
        "native_eager": (lambda: (lambda: chain(handoff)(x, ids, w)), False),
        "python_sync": (lambda: (lambda: base.python_sync(x, ids, w)), False),
        "python_callback": (lambda: graphed(base.python_callback, x, ids, w), False),
    }


def print_row(r: dict) -> None:
    if "error" in r:
        print(f"{r['T']:>3} {r['variant']:<16} ERROR {r['error']}", flush=True)
        return
    h = r.get("handoff_us_per_layer")
    mark = "" if h is None or not r["variant"].startswith(("native", "memops")) else (
        f"  (target <= {TARGET_US:g}: {'met' if h <= TARGET_US else 'missed'})")
    inside = "" if "cpu_us_per_layer_in_pipeline" not in r else (
        f"  [in pipeline: CPU work {r['cpu_us_per_layer_in_pipeline']:.2f} us/layer, "
        f"handoff {r['handoff_us_per_layer_in_pipeline']:.2f}]")
    print(f"{r['T']:>3} {r['variant']:<16} {r['us_per_step']:>10.1f} {r['us_per_layer']:>9.2f} "
          f"{'' if h is None else f'{h:.2f}':>17}{mark}{inside}", flush=True)
