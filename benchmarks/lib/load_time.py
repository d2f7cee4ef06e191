"""Load time: a cold start from BF16 safetensors (experts quantized at load) vs a `hybridmoe convert`ed
directory vs the expert cache of an earlier start, native int4 experts, one real-shape checkpoint.

    python3 benchmarks/load.py time --model DIR [--group-size 128] [--json out.json]

DIR: e.g. `hybridmoe make-model --arch qwen3_moe --preset qwen3-30b-a3b --layers 2 --out DIR`.
Run on an idle machine; page cache is warm for every row (the files were just read or written).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.weights.convert import convert_checkpoint

from .cli import write_json


def timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def add_arguments(parser):
    parser.add_argument("--model", required=True)
    parser.add_argument("--group-size", type=int, default=128)


def run(args) -> int:
    work = Path(tempfile.mkdtemp(prefix="load-time-"))
    base = dict(expert_backend="native", expert_format="int4", expert_group_size=args.group_size)
    rows = {}
    rows["cold start from bf16 safetensors (no cache)"] = timed(
        lambda: load_model(args.model, EngineConfig(**base, cache_dir="")))
    rows["first start, writing the expert cache"] = timed(
        lambda: load_model(args.model, EngineConfig(**base, cache_dir=str(work / "cache"))))
    rows["next start, from the expert cache"] = timed(
        lambda: load_model(args.model, EngineConfig(**base, cache_dir=str(work / "cache"))))
    rows["hybridmoe convert (once)"] = timed(
        lambda: convert_checkpoint(args.model, work / "converted", "int4", args.group_size, progress=False))
    rows["start from the converted directory"] = timed(
        lambda: load_model(work / "converted", EngineConfig(**base, cache_dir="")))
    print(f"| {'load of ' + Path(args.model).name + f', int4 g{args.group_size} experts':<52} | seconds |")
    print(f"|{'-' * 54}|---------|")
    for name, seconds in rows.items():
        print(f"| {name:<52} | {seconds:7.2f} |")
    write_json(args.json, {"model": args.model, "seconds": rows})
    return 0
