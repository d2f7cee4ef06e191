"""The harness of the benchmarks that measure a model on random token prompts, all on the CPU with the torch
reference experts (`benchmarks/quality.py deferral` and `route-prediction`): their shared options, the load,
the prompts, one measurement per model (each --model directory, then the --synthetic preset written to
memory for the run) and the results' JSON."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from hybridmoe.bench.synthetic import synthetic_checkpoint
from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import LoadedModel, load_model
from hybridmoe.errors import HybridMoEError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", action="append", default=[], metavar="DIR", help="repeat for several models")
    parser.add_argument("--synthetic", metavar="PRESET", help="also a make-model preset, written to memory")
    parser.add_argument("--layers", type=int, help="with --synthetic: decoder layers (default: full depth)")
    parser.add_argument("--prompts", type=int, default=4, help="random prompts per model")
    parser.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt (each position is measured)")
    parser.add_argument("--dtype", default="auto", help="compute dtype (default: the checkpoint's)")
    parser.add_argument("--seed", type=int, default=0)


def load_reference(model_dir: str, args: argparse.Namespace) -> LoadedModel:
    """The model with every routed expert in the torch reference on the CPU, its KV cache for one prompt."""
    loaded = load_model(model_dir, EngineConfig(dtype=args.dtype, expert_backend="torch", gpu_experts_per_layer=0,
                                                max_num_seqs=1, max_model_len=args.prompt_len))
    loaded.model.allocate_kv_cache(1, args.prompt_len)
    return loaded


def random_prompts(vocab_size: int, args: argparse.Namespace) -> list[list[int]]:
    g = torch.Generator().manual_seed(args.seed)
    return [torch.randint(0, vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]


def measure_each(args: argparse.Namespace, measure: Callable[[str], list[dict]]) -> list[dict]:
    """measure(model_dir)'s rows for each --model, then for the --synthetic preset; a one-line exit if neither."""
    if not args.model and not args.synthetic:
        raise HybridMoEError("give --model DIR or --synthetic PRESET")
    rows = [row for model_dir in args.model for row in measure(model_dir)]
    if args.synthetic:
        with synthetic_checkpoint(args.synthetic, args.layers, seed=args.seed) as synthetic:
            rows += measure(str(synthetic.out_dir))
    return rows


def results_json(args: argparse.Namespace, rows: list[dict]) -> dict:
    """The rows with the prompts they were measured on."""
    return {"prompts": args.prompts, "prompt_len": args.prompt_len, "seed": args.seed, "results": rows}
