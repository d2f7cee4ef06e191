"""`hybridmoe convert`: pack a checkpoint's routed experts for the native engine, once, into a new directory."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="source: a Hugging Face model directory (bf16/fp8/GPTQ/AWQ), a .gguf file, or a Hub "
                             "repo id (org/name, org/name:Q4_K_M for a GGUF repo)")
    parser.add_argument("--revision", default=None, help="branch, tag or commit hash of a Hub repo id --model")
    parser.add_argument("--format", default="auto", choices=["auto", "bf16", "int8", "int4", "fp8"],
                        help="packed expert format (default auto: the one a load picks, nearest the checkpoint's)")
    parser.add_argument("--group-size", type=int, default=None, choices=[32, 64, 128],
                        help="int4 group size (default: a 4-bit checkpoint's own: GPTQ/AWQ's, 32 for GGUF Q4; else 128)")
    parser.add_argument("--out", required=True, help="directory to write (new or empty)")
    parser.add_argument("--force", action="store_true", help="replace an earlier conversion in --out")
    parser.add_argument("--cpu-threads", type=int, default=None, help="packing threads (default: every core)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from hybridmoe.config import format_bytes
    from hybridmoe.weights.convert import convert_checkpoint
    from hybridmoe.weights.hub import resolve_model_source

    src = resolve_model_source(args.model, args.revision)  # a Hub repo id -> its files in the Hub cache
    s = convert_checkpoint(src, args.out, format=args.format, group_size=args.group_size, force=args.force,
                           threads=args.cpu_threads, progress=not args.quiet)
    group = f" g{s.group_size}{' with zero points' if s.zero_points else ''}" if s.format == "int4" else ""
    print(f"wrote {s.out_dir}: {s.moe_layers} MoE layers of experts in {s.format}{group} "
          f"({format_bytes(s.expert_bytes)}) + {format_bytes(s.other_bytes)} of other weights in {s.seconds:.1f} s; "
          f"run it with --model {s.out_dir} (the engine options it needs are read from it)")
    return 0
