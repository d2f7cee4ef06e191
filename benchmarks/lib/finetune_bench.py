"""LoRA fine-tuning speed and memory (issue #31): hybridmoe against accelerate's expert offload and the all-GPU model.

    python3 benchmarks/finetune.py sft [--synthetic qwen3-30b-a3b,deepseek-v2-lite] [--layers 4] [--seq-len 1024]
        [--batch-size 1] [--steps 6] [--warmup 2] [--lora-rank 8] [--setups hybridmoe,accelerate,gpu]
        [--expert-format bf16] [--device cuda|cpu] [--json F]

Per model (a make-model preset with random weights, cut to --layers, written once and read by every setup), each
setup trains LoRA adapters on the attention projections in a process of its own (finetune_worker.py: its peak RSS
and GPU memory are its own, a failure loses only its row) on the same random token batches, labels = inputs:
(a) hybridmoe, routed experts in the native CPU engine, the rest on the GPU; (b) accelerate, transformers'
device_map with every routed-experts module on "cpu", its weights copied to the GPU each forward; (c) gpu,
everything on the GPU, skipped where the weights and a margin exceed the free GPU memory (finetune_setups.py).
Reported: tokens/s over the timed steps, peak GPU memory (torch.cuda.max_memory_allocated of the setup's process),
peak RSS (the process's, and its training steps' alone), each setup's tokens/s over (b)'s and over (c)'s, and the
first step's loss, before any update (the same weights and tokens: close across setups). Issue #31's target: (a) >= 5x (b)'s tokens/s and >= 1/2 of (c)'s.
--device cpu is the smoke run (no GPU): every setup on the CPU, (b) with accelerate's hooks executing on the CPU.
A cut model's tokens/s are per its depth. --json is rewritten after each setup, and SIGTERM (a `timeout`) ends the
run with the table of the setups measured so far.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from hybridmoe.bench.synthetic import synthetic_checkpoint
from hybridmoe.errors import HybridMoEError

from .cli import Stopped, int_list, options, str_list, write_json
from .finetune_report import TARGET_OF_GPU, TARGET_OVER_ACCELERATE, print_report
from .finetune_setups import LOADERS

ROOT = Path(__file__).resolve().parents[2]
"""The repository root: the workers run as `python3 -m benchmarks.lib.finetune_worker` from there."""


def add_arguments(parser) -> None:
    parser.add_argument("--synthetic", default="qwen3-30b-a3b",
                        help="make-model presets, comma-separated (e.g. qwen3-30b-a3b,deepseek-v2-lite or "
                             "qwen3_moe:tiny)")
    parser.add_argument("--layers", default="4", help="decoder layers of each cut model: one for all, or one per "
                                                      "preset, comma-separated (default 4)")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=6, help="timed training steps (default 6)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them (default 2)")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--setups", default=",".join(LOADERS), help=f"any of {', '.join(LOADERS)}")
    parser.add_argument("--expert-format", default="bf16", help="hybridmoe's routed experts' format (default bf16)")
    parser.add_argument("--cpu-threads", type=int, default=None,
                        help="hybridmoe's expert engine threads (default: every CPU this process may use)")
    parser.add_argument("--experts-implementation", default=None,
                        help="transformers' experts_implementation for accelerate and gpu (default: its own choice)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default cuda when there is one, else cpu)")
    parser.add_argument("--checkpoint-root", default=None,
                        help="where the synthetic checkpoints are written (default /dev/shm)")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="each setup's process at most (default 600)")
    parser.add_argument("--seed", type=int, default=0)


def run_setup(spec: dict, timeout_s: float, result_file: Path) -> dict:
    """One setup's row from its own process, which writes it to result_file: its measurements, {"skipped": why} or
    {"error": why}; where the process wrote nothing (killed, crashed), the error and the end of its output."""
    cmd = [sys.executable, "-m", "benchmarks.lib.finetune_worker", json.dumps({**spec, "result_file": str(result_file)})]
    try:
        done = subprocess.run(cmd, check=False, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              errors="replace", timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"ran past --timeout-s {timeout_s:.0f}"}
    if result_file.is_file():
        return json.loads(result_file.read_text())
    ending = " | ".join(done.stdout.strip().splitlines()[-6:])
    how = f"killed by signal {-done.returncode}" if done.returncode < 0 else f"exit status {done.returncode}"
    return {"error": f"the setup's process wrote no result ({how}); its output ended: {ending}"}


def model_list(args) -> list[tuple[str, int]]:
    """(preset, layers) of each model --synthetic and --layers name."""
    presets, layers = str_list(args.synthetic), int_list(args.layers)
    if len(layers) == 1:
        layers = layers * len(presets)
    if not presets or len(layers) != len(presets):
        raise HybridMoEError(f"--layers {args.layers!r} gives {len(layers)} depths for {len(presets)} presets "
                             f"({args.synthetic!r}): give one for all or one per preset")
    return list(zip(presets, layers))


def setup_list(text: str) -> list[str]:
    setups = str_list(text)
    unknown = [s for s in setups if s not in LOADERS]
    if not setups or unknown:
        raise HybridMoEError(f"--setups {text!r}: {', '.join(unknown) or 'none given'}; choose from "
                             f"{', '.join(LOADERS)}")
    return setups


def measure_model(preset: str, layers: int, setups: list[str], args, device: str, rows: list[dict]) -> None:
    """Each setup's row for one model appended to rows, in --setups order, and --json rewritten after each."""
    mine = []
    with (synthetic_checkpoint(preset, layers, seed=args.seed, root=args.checkpoint_root) as ckpt,
          tempfile.TemporaryDirectory(prefix="finetune-bench-") as results):
        for setup in setups:
            spec = {"setup": setup, "model_dir": str(ckpt.out_dir), "device": device, "seq_len": args.seq_len,
                    "batch_size": args.batch_size, "warmup": args.warmup, "steps": args.steps,
                    "lora_rank": args.lora_rank, "seed": args.seed, "expert_format": args.expert_format,
                    "cpu_threads": args.cpu_threads, "experts_implementation": args.experts_implementation,
                    "checkpoint_bytes": ckpt.total_bytes}
            print(f"{preset} ({layers} layers, {ckpt.total_bytes / (1 << 30):.1f} GiB): {setup} ...", flush=True)
            row = {"model": preset, "layers": layers, "setup": setup, **run_setup(spec, args.timeout_s, Path(results) / f"{setup}.json")}
            print(f"  {outcome(row)}", flush=True)
            mine.append(row)
            rows.append(row)
            add_ratios(mine)
            write_results(args, device, rows, [])


def add_ratios(rows: list[dict]) -> None:
    """Each measured row's tokens/s over the accelerate row's (x_accelerate) and the gpu row's (x_gpu) of its model,
    where those were measured."""
    speed = {row["setup"]: row.get("tokens_per_s") for row in rows}
    for row in rows:
        if row.get("tokens_per_s"):
            for setup in ("accelerate", "gpu"):
                row[f"x_{setup}"] = row["tokens_per_s"] / speed[setup] if speed.get(setup) else None


def outcome(row: dict) -> str:
    if "error" in row:
        return f"error: {row['error']}"
    if "skipped" in row:
        return f"skipped: {row['skipped']}"
    gpu = f", peak GPU {row['peak_gpu_gib']:.2f} GiB" if row.get("peak_gpu_gib") is not None else ""
    return f"{row['tokens_per_s']:.1f} tokens/s, peak RSS {row['peak_rss_gib']:.2f} GiB{gpu}; {row['note']}"


def write_results(args, device: str, rows: list[dict], notes: list[str]) -> None:
    write_json(args.json, {"command": "sft", "device": device, "options": options(args), "notes": notes,
                           "targets": {"x_accelerate": TARGET_OVER_ACCELERATE, "x_gpu": TARGET_OF_GPU},
                           "rows": rows})


def check_counts(args) -> None:
    if args.steps < 1 or args.warmup < 0 or args.seq_len < 2 or args.batch_size < 1 or args.lora_rank < 1:
        raise HybridMoEError("--steps, --batch-size and --lora-rank must be at least 1, --seq-len at least 2 and "
                             "--warmup at least 0")


def run(args) -> int:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    check_counts(args)
    setups, models = setup_list(args.setups), model_list(args)
    rows, notes = [], []
    try:
        for preset, layers in models:
            measure_model(preset, layers, setups, args, device, rows)
    except Stopped:
        notes.append("stopped by SIGTERM (time limit): the setups after the last row not measured")
    print_report(rows, device, args.seq_len * args.batch_size, notes)
    write_results(args, device, rows, notes)
    return 0
