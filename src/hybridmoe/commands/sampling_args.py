"""Sampling flags shared by run and chat, mapped onto SamplingParams."""

from __future__ import annotations

import argparse

from hybridmoe.sampling_params import SamplingParams


def add_sampling_arguments(parser: argparse.ArgumentParser, max_new_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    defaults = SamplingParams()
    group.add_argument("--max-new-tokens", type=int, default=max_new_tokens, metavar="N",
                       help=f"most tokens to generate (default: {max_new_tokens})")
    group.add_argument("--temperature", type=float, default=defaults.temperature, metavar="T",
                       help=f"0 is greedy (default: {defaults.temperature})")
    group.add_argument("--top-p", type=float, default=defaults.top_p, help=f"(default: {defaults.top_p})")
    group.add_argument("--top-k", type=int, default=defaults.top_k, help="0 disables (default: 0)")
    group.add_argument("--min-p", type=float, default=defaults.min_p, help=f"(default: {defaults.min_p})")
    group.add_argument("--repetition-penalty", type=float, default=defaults.repetition_penalty,
                       help=f"1 disables (default: {defaults.repetition_penalty})")
    group.add_argument("--seed", type=int, default=None, metavar="S", help="seed for reproducible sampling")
    group.add_argument("--stop", action="append", default=[], metavar="TEXT",
                       help="stop before this text (repeatable)")
    group.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS tokens")


def sampling_params(args: argparse.Namespace, **overrides) -> SamplingParams:
    values = dict(max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                  seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
    return SamplingParams(**(values | overrides))
