"""Everything in one process: `build`, `llama` for each of --models, then `kt`, each with its own defaults.

    python3 benchmarks/peers.py all [--models qwen3-30b-a3b,deepseek-v2-lite] [--layers 8] [--threads N]
        [--device cuda|cpu] [--build-dir /tmp/peers-build] [--work-dir /tmp/peers-models] [--json F]

On the GPU host this runs past one 10-minute device call: run the parts in calls of their own instead
(docs/benchmarks.md); the build directory and the GGUF files are reused from one call to the next on the same
machine. With --json F each part writes its own file beside F (F.llama-MODEL.json, F.kt.json).
"""

from __future__ import annotations

import argparse

from . import peers_kt, peers_llama
from .cli import str_list
from .peers_build import add_build_arguments, build


def add_arguments(parser) -> None:
    parser.add_argument("--models", default="qwen3-30b-a3b,deepseek-v2-lite", help="make-model presets for `llama`")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--device", default=None)
    parser.add_argument("--work-dir", default="/tmp/peers-models")
    add_build_arguments(parser)


def part_args(module, argv: list[str]) -> argparse.Namespace:
    """A part's options as its own subcommand would parse argv."""
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    p.add_argument("--json")
    return p.parse_args(argv)


def run(args) -> int:
    common = ([f"--threads={args.threads}"] if args.threads else []) + \
             ([f"--device={args.device}"] if args.device else [])
    built = ["--build-dir", args.build_dir, "--source", args.source, "--jobs", str(args.jobs)] + \
            (["--cpu-only"] if args.cpu_only else [])
    build(args.source, args.build_dir, args.jobs, args.cpu_only)
    for model in str_list(args.models):
        argv = ["--model", model, "--layers", str(args.layers), "--work-dir", args.work_dir, *common, *built]
        if args.json:
            argv += ["--json", f"{args.json}.llama-{model.replace(':', '-')}.json"]
        peers_llama.run(part_args(peers_llama, argv))
    kt = [f"--threads={args.threads}"] if args.threads else []
    peers_kt.run(part_args(peers_kt, kt + (["--json", f"{args.json}.kt.json"] if args.json else [])))
    return 0
