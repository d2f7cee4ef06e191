"""`hybridmoe make-model`: write a Hugging Face-format MoE checkpoint with random weights.

Its config.json says so (hybridmoe_random_weights: true): run, chat, serve and bench then print that the text
is noise, and serve's web page shows it."""

from __future__ import annotations

import argparse
import time

from hybridmoe.checkpoint.presets import ARCHS, OPTIONAL_KEYS, PRESETS, text_config_of
from hybridmoe.errors import HybridMoEError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    presets = "; ".join(f"{arch}: {', '.join(p)}" for arch, p in PRESETS.items())
    parser.add_argument("--arch", required=True, choices=list(ARCHS), metavar="|".join(ARCHS), help="model family")
    parser.add_argument("--preset", required=True, metavar="NAME", help=f"model shape ({presets})")
    parser.add_argument("--out", required=True, metavar="DIR", help="directory to write (new or empty)")
    parser.add_argument("--layers", type=int, default=None, metavar="N",
                        help="number of decoder layers (default: the preset's)")
    parser.add_argument("--dtype", choices=["bf16", "fp32", "fp8"], default="bf16", metavar="bf16|fp32|fp8",
                        help="weight dtype (default: bf16); fp8: linears in block-FP8 e4m3 (128x128 scales, as "
                             "DeepSeek-V3 ships), the rest bf16")
    parser.add_argument("--seed", type=int, default=0, metavar="S",
                        help="random seed; same seed, same bytes (default: 0)")
    parser.add_argument("--mtp-layers", type=int, default=0, metavar="N",
                        help="qwen3_next, qwen3_5_moe: also write N multi-token-prediction layers under mtp.*, which "
                             "--mtp loads (default: 0, none)")
    parser.add_argument("--force", action="store_true", help="replace a checkpoint already in --out (default: off)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar (default: off)")


def run(args: argparse.Namespace) -> int:
    from hybridmoe.checkpoint import make_checkpoint

    start = time.perf_counter()
    if args.mtp_layers and "mtp_num_hidden_layers" not in OPTIONAL_KEYS.get(args.arch, ()):
        takes = ", ".join(a for a, keys in OPTIONAL_KEYS.items() if "mtp_num_hidden_layers" in keys)
        raise HybridMoEError(f"--mtp-layers: {args.arch} has no multi-token-prediction module here ({takes} do)")
    if args.mtp_layers < 0:
        raise HybridMoEError(f"--mtp-layers is 0 or more, got {args.mtp_layers}")
    overrides = {"mtp_num_hidden_layers": args.mtp_layers} if args.mtp_layers else None
    summary = make_checkpoint(args.arch, args.preset, args.out, layers=args.layers, dtype=args.dtype,
                              seed=args.seed, force=args.force, progress=not args.quiet, overrides=overrides)
    seconds = time.perf_counter() - start
    cfg = summary.config
    layers = text_config_of(cfg)["num_hidden_layers"]
    print(f"wrote {summary.out_dir}: {cfg['architectures'][0]} {args.preset}, {layers} layers, "
          f"{summary.num_tensors} tensors, {summary.total_bytes / 1e9:.3f} GB in {len(summary.shards)} shards, "
          f"{seconds:.1f} s ({summary.total_bytes / 1e6 / seconds:.0f} MB/s); random weights: its text is noise")
    return 0
