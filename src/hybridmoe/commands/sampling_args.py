"""Sampling flags shared by run and chat, mapped onto SamplingParams.

The defaults are SamplingParams' own (vLLM's and OpenAI's: temperature 1, every filter off), the same as
the OpenAI server's for a request that leaves a field out. Without --max-new-tokens a reply runs until a
stop token or the end of the context, as the server's chat endpoints do.
"""

from __future__ import annotations

import argparse

from hybridmoe.sampling_params import MAX_TEMPERATURE, MIN_TEMPERATURE, PENALTY_RANGE, SamplingParams

UNTIL_CONTEXT_ENDS = "until a stop token or the context is full"


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    d = SamplingParams()
    low, high = PENALTY_RANGE
    group.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                       help=f"most tokens to generate (default: {UNTIL_CONTEXT_ENDS})")
    group.add_argument("--temperature", type=float, default=d.temperature, metavar="T",
                       help=f"0 is greedy, else {MIN_TEMPERATURE:g}-{MAX_TEMPERATURE:g} (default: {d.temperature:g})")
    group.add_argument("--top-p", type=float, default=d.top_p, metavar="P",
                       help=f"keep the likeliest tokens up to this probability, (0, 1] (default: {d.top_p:g}, off)")
    group.add_argument("--top-k", type=int, default=d.top_k, metavar="K",
                       help=f"keep the K likeliest tokens (default: {d.top_k}, off)")
    group.add_argument("--min-p", type=float, default=d.min_p, metavar="P",
                       help=f"drop tokens below P times the likeliest one's probability, 0-1 "
                            f"(default: {d.min_p:g}, off)")
    group.add_argument("--repetition-penalty", type=float, default=d.repetition_penalty, metavar="R",
                       help=f"penalize tokens already seen, {low:g}-{high:g} (default: {d.repetition_penalty:g}, off)")
    group.add_argument("--seed", type=int, default=None, metavar="S",
                       help="seed for reproducible sampling (default: a random one)")
    group.add_argument("--stop", action="append", default=[], metavar="TEXT",
                       help="stop before this text; repeatable (default: none)")
    group.add_argument("--ignore-eos", action="store_true",
                       help="keep generating past end-of-sequence tokens (default: off)")


def sampling_params(args: argparse.Namespace, room: int) -> SamplingParams:
    """The flags as SamplingParams for a prompt that leaves room tokens of the context: --max-new-tokens,
    or all of that room (at least 1, so that a prompt filling the context meets the engine's own check)."""
    max_tokens = max(room, 1) if args.max_new_tokens is None else args.max_new_tokens
    return SamplingParams(max_tokens=max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
