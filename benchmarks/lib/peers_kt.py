"""kt-kernel's CPU MoE layer against ours (CpuExperts): one layer, decode (T = 1, 4) and prefill (T = 512,
2048) sizes, in bf16, int8 and int4, side by side in one run.

    python3 benchmarks/peers.py kt [--shape qwen3-30b-a3b] [--formats bf16,int8,int4] [--tokens 1,4,512,2048]
        [--threads N] [--reps 30] [--kt-dir .peers/kt_kernel] [--json F]

Both layers hold the same E bf16 experts (benchmarks/lib/moe_layer.py's make_weights) and see the same tokens and
routing (its routing, seeded by T); int8 and int4 are each system's own quantization of them (kt-kernel's AMX
classes per output channel; ours int8 per channel, int4 in groups of --group-size). Decode sizes run back to back
with each call's experts out of the caches (peers_kt_calls.py), as in a model's decode. Per format kt-kernel runs first, in a process of its
own (peers_kt_worker.py: its threads never share cores with ours, and its crash is reported, not fatal), then
ours. Each row: both systems' median ms, ours / kt-kernel as speed (kt ms / our ms: above 1 ours is faster),
the floor (the routed experts' weight bytes, 3 x H x I x bits / 8 per distinct expert, scales left out, at the
host read bandwidth measured in this run: hybridmoe.system.bandwidth.floor_bandwidth) and each system's share
of it, and how far the two layers' outputs are apart. Where kt-kernel cannot run (a Python other than its
wheel's 3.12, a CPU without AVX-512-BF16, no .peers/kt_kernel) the table says why and shows ours alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.cpu_experts import CpuExperts, default_threads
from hybridmoe.experts.torch_ref import ref_moe
from hybridmoe.system.bandwidth import floor_bandwidth, floor_bandwidth_method

from .cli import Stopped, int_list, str_list, write_json
from .common import SHAPES, layer_shape
from .moe_layer import make_weights, routing
from .peers_kt_calls import timed_ms
from .peers_kt_worker import CLASSES, RESULT_MARK, SPINNING_THREADS
from .peers_report import context, context_lines, fmt, ratio, table
from .peers_sources import KT_DIR, ROOT

BITS = {"bf16": 16, "int8": 8, "int4": 4}


def add_arguments(parser) -> None:
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=SHAPES)
    parser.add_argument("--experts", type=int, help="override E (to fit a small machine)")
    parser.add_argument("--formats", default="bf16,int8,int4")
    parser.add_argument("--tokens", default="1,4,512,2048")
    parser.add_argument("--threads", type=int, help="both systems' threads (default: every CPU this process may use)")
    parser.add_argument("--group-size", type=int, default=128, help="our int4 group size (default 128)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--budget-s", type=float, default=3.0, help="seconds per (format, T) per system at most")
    parser.add_argument("--kt-dir", default=str(KT_DIR), help=f"kt-kernel's trimmed wheel (default {KT_DIR})")
    parser.add_argument("--kt-timeout-s", type=float, default=240.0, help="kt-kernel's process per format at most")
    parser.add_argument("--kt-python", default=sys.executable,
                        help="the Python that runs kt-kernel's side (default this one; its wheel needs CPython 3.12, "
                             "torch, and this repository importable)")


def run_kt(spec: dict, python: str, timeout_s: float) -> dict:
    """kt-kernel's measurement of one format in its own process: its result, or {"error": why}."""
    cmd = [python, "-m", "benchmarks.lib.peers_kt_worker", json.dumps(spec)]
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, errors="replace", timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"ran past {timeout_s:.0f} s"}
    found = [line[len(RESULT_MARK):] for line in done.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if found:
        return json.loads(found[-1])
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-12:])
    how = f"killed by signal {-done.returncode}" if done.returncode < 0 else f"exit {done.returncode}"
    return {"error": f"kt-kernel's process ended without a result ({how}):\n{tail}"}


def run_ours(fmt_name: str, gate, up, down, shape: dict, tokens: list[int], threads: int, group_size: int,
             reps: int, budget_s: float) -> tuple[dict, dict, dict, str, float]:
    """Our layer of one format: median ms, mean distinct experts per timed call and the output per T, the ISA
    its kernels use, its packing seconds."""
    H, E, K = shape["H"], shape["E"], shape["K"]
    t0 = time.perf_counter()
    ex = CpuExperts(gate, up, down, format=fmt_name, group_size=group_size, threads=threads)
    pack_s = time.perf_counter() - t0
    ms, outputs, touched = {}, {}, {}
    for T in tokens:
        outputs[T] = ex.forward(*routing(T, H, E, K, seed=T))
        ms[T], touched[T] = timed_ms(ex.forward, T, H, E, K, reps, budget_s)
    return ms, touched, outputs, ex.isa, pack_s


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def format_rows(name: str, shape: dict, tokens: list[int], bandwidth: float, ours: dict, touched_of: dict,
                kt: dict, ours_out: dict, kt_out: dict) -> list[dict]:
    """One row per T of one format."""
    expert_bytes = 3 * shape["H"] * shape["I"] * BITS[name] / 8
    rows = []
    for T in tokens:
        touched = touched_of[T]
        floor_ms = touched * expert_bytes / bandwidth * 1e3
        kt_ms = kt.get("ms", {}).get(str(T))
        rows.append(dict(format=name, tokens=T, experts_touched=touched, ours_ms=ours[T], kt_ms=kt_ms,
                         ours_over_kt=ratio(kt_ms, ours[T]), floor_ms=floor_ms, ours_of_floor=floor_ms / ours[T],
                         kt_of_floor=floor_ms / kt_ms if kt_ms else None,
                         output_diff=rel_diff(kt_out[T], ours_out[T]) if T in kt_out else None))
    return rows


def report(rows: list[dict], notes: list[str], ctx: dict, head: str) -> str:
    cells = [[r["format"], str(r["tokens"]), fmt(r["experts_touched"], ".4g"), fmt(r["kt_ms"], ".3f"),
              fmt(r["ours_ms"], ".3f"),
              fmt(r["ours_over_kt"], ".2f"), fmt(r["floor_ms"], ".3f"),
              fmt(None if r["kt_of_floor"] is None else 100 * r["kt_of_floor"], ".0f"),
              fmt(100 * r["ours_of_floor"], ".0f"), fmt(r["output_diff"], ".4f")] for r in rows]
    lines = [*context_lines(ctx), head, *[f"# {n}" for n in notes], ""]
    lines += table(["format", "T", "experts", "kt-kernel ms", "ours ms", "ours / kt-kernel", "floor ms",
                    "kt % of floor", "ours % of floor", "output diff"], cells)
    return "\n".join(lines)


def measure_format(args, name: str, weights: tuple, shape: dict, tokens: list[int], threads: int, tmp: str,
                   bandwidth: float) -> tuple[list[dict], list[str], dict, float]:
    """One format: kt-kernel's layer in its own process, then ours; the rows, notes, kt-kernel's result and the
    host read probe taken after."""
    E, H, I, K = shape["E"], shape["H"], shape["I"], shape["K"]
    spec = dict(kt_dir=str(Path(args.kt_dir).resolve()), format=name, E=E, H=H, I=I, K=K, tokens=tokens,
                threads=threads, reps=args.reps, budget_s=args.budget_s, outputs=f"{tmp}/{name}.pt")
    kt = run_kt(spec, args.kt_python, args.kt_timeout_s)
    if "error" in kt:
        kt_out, notes = {}, [f"kt-kernel {name}: not measured: {kt['error']}"]
    else:
        kt_out = torch.load(spec["outputs"])
        notes = [f"kt-kernel {name}: {kt['class']} from its {kt['variant']} extension, loaded and quantized in "
                 f"{kt['load_s']:.1f} s"]
    torch.set_num_threads(1)
    time.sleep(1.0)  # torch's OpenMP workers stop spinning on the cores ours are pinned to
    ours, touched, ours_out, isa, pack_s = run_ours(name, *weights, shape, tokens, threads, args.group_size, args.reps,
                                           args.budget_s)
    notes.append(f"ours {name}: CpuExperts on its {isa} kernels, packed in {pack_s:.1f} s")
    x, ids, w = routing(tokens[0], H, E, K, seed=tokens[0])
    ref = ref_moe(x.float(), *weights, ids, w)
    errs = {"ours": rel_diff(ours_out[tokens[0]], ref)}
    if tokens[0] in kt_out:
        errs["kt-kernel"] = rel_diff(kt_out[tokens[0]], ref)
    notes.append(f"{name} at T={tokens[0]}, error vs the float32 reference of the bf16 weights: "
                 + ", ".join(f"{k} {v:.4f}" for k, v in errs.items()))
    after = floor_bandwidth(2 << 30, threads)
    rows = format_rows(name, shape, tokens, max(bandwidth, after), ours, touched, kt, ours_out, kt_out)
    return rows, notes, kt, after


def run(args) -> int:
    shape = layer_shape(args.shape, args.experts)
    threads = args.threads or default_threads()
    tokens, formats = int_list(args.tokens), str_list(args.formats)
    unknown = [f for f in formats if f not in CLASSES]
    if unknown:
        raise HybridMoEError(f"--formats takes {', '.join(CLASSES)}, got {', '.join(unknown)}")
    ctx = context()
    probes = [floor_bandwidth(2 << 30, threads)]
    weights = make_weights(shape["E"], shape["H"], shape["I"])
    rows, notes, kt_runs = [], [], {}
    try:
        with tempfile.TemporaryDirectory(prefix="peers-kt-") as tmp:
            for name in formats:
                got, said, kt_runs[name], after = measure_format(args, name, weights, shape, tokens, threads, tmp,
                                                                 probes[-1])
                rows, notes, probes = rows + got, notes + said, probes + [after]
    except Stopped:
        notes.append("stopped by SIGTERM (time limit): the formats after the last row not measured")
    head = (f"# one MoE layer, {args.shape}: E={shape['E']} H={shape['H']} I={shape['I']} top-{shape['K']}, "
            f"{threads} CPUs each (ours: {threads} threads; kt-kernel: {max(1, threads - SPINNING_THREADS)} pool workers, its "
            f"TaskQueue thread and the caller); floor at {', '.join(f'{b / 1e9:.1f}' for b in probes)} GB/s "
            f"({floor_bandwidth_method()}; a format's rows at the higher of the probes around it)")
    print(report(rows, notes, ctx, head))
    write_json(args.json, {"context": ctx, "shape": shape, "threads": threads, "bandwidth_probes_gbps":
                           [b / 1e9 for b in probes], "kt_kernel": kt_runs, "notes": notes, "rows": rows})
    return 0
