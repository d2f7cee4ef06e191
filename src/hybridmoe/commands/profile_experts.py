"""`hybridmoe profile-experts --model DIR --prompts FILE --out stats.json`: routing counts per layer per expert.

Runs every prompt of FILE (one per line; blank lines skipped) through the model and a few greedy
tokens past it, and counts, for each MoE layer and routed expert, the tokens routed to it (prefill
and decode). `--expert-placement frequency --expert-stats stats.json` then puts the most-routed
experts on the GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hybridmoe.commands.engine_args import add_engine_arguments, engine_kwargs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="PATH",
                        help="a Hugging Face model directory, a .gguf file or a Hub repo id (org/name[:QUANT])")
    parser.add_argument("--prompts", required=True, metavar="FILE", help="text file, one prompt per line")
    parser.add_argument("--out", required=True, metavar="FILE", help="where to write the statistics JSON")
    parser.add_argument("--max-tokens", type=int, default=16,
                        help="greedy tokens generated after each prompt, so decode routing counts too (default 16)")
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from hybridmoe.errors import HybridMoEError
    from hybridmoe.experts.placement_stats import RoutingCounter
    from hybridmoe.llm import LLM
    from hybridmoe.sampling_params import SamplingParams

    try:
        prompts = [line for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise HybridMoEError(f"cannot read --prompts {args.prompts} ({e})") from None
    if not prompts:
        raise HybridMoEError(f"--prompts {args.prompts} holds no prompt; write one per line")
    if args.max_tokens < 1:
        raise HybridMoEError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    llm = LLM(args.model, **engine_kwargs(args))
    model = llm.engine.runner.model
    counter = RoutingCounter.install(model)
    llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
    stats = counter.stats()
    Path(args.out).write_text(stats.to_json(model_type=model.config.get("model_type"),
                                            num_experts=model.expert_dims()[0]) + "\n")
    print(f"{len(prompts)} prompts, {stats.tokens} tokens through {len(stats.counts)} MoE layers -> {args.out}",
          file=sys.stderr)
    return 0
