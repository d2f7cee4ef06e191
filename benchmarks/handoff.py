"""Per-layer cost of ordering CPU expert work on a CUDA stream: native host functions vs Python.

A decode step of L layers (default 48); each layer copies hidden [T, H], topk_ids [T, K] and
topk_weights [T, K] to pinned staging buffers (D2H), runs a toy CPU step (a small CpuExperts
layer), copies its output back (H2D) and adds it on the GPU. Variants, all in this process:

  gpu_only         the copies and the add, no CPU step (CUDA graph): the floor
  native           CudaHandoff.enqueue: one native host function per layer (graph)
  native_split     enqueue_submit + enqueue_wait: two native host functions per layer (graph)
  native_eager     CudaHandoff.enqueue launched from Python every step (no graph)
  python_callback  a Python host function (ctypes; takes the GIL) running CpuExperts.forward (graph)
  python_sync      Python synchronizes the stream, runs CpuExperts.forward, copies back (no graph)
  cpu_step         the native CPU step alone: the L layers in a row without CUDA (run_on_host)

handoff µs/layer = (variant - gpu_only) / L - cpu_step / L: what ordering the CPU work on the
stream costs beyond the copies and the CPU work itself. Target for the native handoff: <= 10 µs.

    python benchmarks/handoff.py --layers 48 --tokens 1,4 --json out/handoff.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time

import torch

from hybridmoe import CpuExperts
from hybridmoe.experts.cuda_handoff import CudaHandoff

TARGET_US = 10.0
HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--tokens", default="1,4", help="comma-separated T values")
    p.add_argument("--hidden", type=int, default=2048, help="H (Qwen3-30B-A3B: 2048)")
    p.add_argument("--experts", type=int, default=8, help="E of the toy CPU step")
    p.add_argument("--intermediate", type=int, default=32, help="I of the toy CPU step")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--threads", type=int, default=4, help="CPU expert workers of the toy step")
    p.add_argument("--reps", type=int, default=100, help="steps per timed trial")
    p.add_argument("--trials", type=int, default=5, help="timed trials (the median is reported)")
    p.add_argument("--json", help="write the results here")
    return p.parse_args()


def seconds_per_call(fn, reps: int, trials: int) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / reps)
    return statistics.median(samples)


def graphed(step, *inputs):
    """step captured in a CUDA graph (after a warm-up on a side stream); returns graph.replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(*inputs)
    return graph.replay


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


def main():
    args = parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    E, H, I, K, L = args.experts, args.hidden, args.intermediate, args.top_k, args.layers
    g = torch.Generator().manual_seed(0)
    experts = CpuExperts(torch.randn(E, I, H, generator=g) / H**0.5, torch.randn(E, I, H, generator=g) / H**0.5,
                         torch.randn(E, H, I, generator=g) / I**0.5, format="bf16", threads=args.threads)
    # One toy layer behind every handoff layer: the CPU step stays small and cached.
    handoff = CudaHandoff([experts] * L, max_tokens=max(tokens), top_k=K)
    base = Baselines(experts, L, max(tokens), H, K, handoff.runtime)

    def native(x, ids, w):
        for layer in range(L):
            x = x + handoff.enqueue(None, layer, x, ids, w)
        return x

    def native_split(x, ids, w):
        for layer in range(L):
            handoff.enqueue_submit(None, layer, x, ids, w)
            x = x + handoff.enqueue_wait(None, layer)
        return x

    def cpu_step(T):
        native(x, ids, w)  # stage real inputs for the host functions to run on
        torch.cuda.synchronize()
        return lambda: handoff.run_on_host(range(L), T)

    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cudart": handoff.runtime,
            "cpus": len(os.sched_getaffinity(0)), "isa": experts.isa, "layers": L, "H": H, "E": E, "I": I, "K": K,
            "threads": args.threads, "reps": args.reps, "trials": args.trials}
    print(f"{info['gpu']}, torch {info['torch']}, cudart {info['cudart']}, {info['cpus']} CPUs, isa {info['isa']}; "
          f"{L} layers, H={H}, toy CPU step E={E} I={I} K={K} on {args.threads} threads")
    print(f"{'T':>3} {'variant':<16} {'us/step':>10} {'us/layer':>9} {'handoff us/layer':>17}", flush=True)
    rows = []
    for T in tokens:
        x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).cuda()
        w = torch.softmax(torch.randn(T, K, generator=g), dim=-1).cuda()
        # The Python host callback last: if it stalls, the native figures are already out.
        runs = {
            "gpu_only": lambda: graphed(base.gpu_only, x, ids, w),
            "cpu_step": lambda: cpu_step(T),
            "native": lambda: graphed(native, x, ids, w),
            "native_split": lambda: graphed(native_split, x, ids, w),
            "native_eager": lambda: (lambda: native(x, ids, w)),
            "python_sync": lambda: (lambda: base.python_sync(x, ids, w)),
            "python_callback": lambda: graphed(base.python_callback, x, ids, w),
        }
        times = {}
        for name, make in runs.items():
            row = {"T": T, "variant": name}
            try:
                t = times[name] = seconds_per_call(make(), args.reps, args.trials)
                handoff.check()
                row.update(us_per_step=t * 1e6, us_per_layer=t * 1e6 / L)
                if name not in ("gpu_only", "cpu_step") and "gpu_only" in times and "cpu_step" in times:
                    row["handoff_us_per_layer"] = (t - times["gpu_only"] - times["cpu_step"]) * 1e6 / L
            except Exception as e:  # one variant failing must not hide the others' numbers
                row["error"] = f"{type(e).__name__}: {e}"
            rows.append(row)
            print_row(row)
            if args.json:
                write_json(args.json, info, rows)


def print_row(r: dict) -> None:
    if "error" in r:
        print(f"{r['T']:>3} {r['variant']:<16} ERROR {r['error']}", flush=True)
        return
    h = r.get("handoff_us_per_layer")
    mark = "" if h is None or not r["variant"].startswith("native") else (
        f"  (target <= {TARGET_US:g}: {'met' if h <= TARGET_US else 'missed'})")
    print(f"{r['T']:>3} {r['variant']:<16} {r['us_per_step']:>10.1f} {r['us_per_layer']:>9.2f} "
          f"{'' if h is None else f'{h:.2f}':>17}{mark}", flush=True)


def write_json(path: str, info: dict, rows: list) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"info": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
