"""`hybridmoe run --model DIR --prompt TEXT`: complete one prompt, streaming the text to stdout.

Only the completion goes to stdout; the engine's choices (doctor's line) and a one-line summary
(tokens, speed) go to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time

from hybridmoe.commands.engine_args import add_engine_arguments, engine_kwargs
from hybridmoe.commands.sampling_args import add_sampling_arguments, sampling_params


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="DIR", help="a Hugging Face model directory")
    parser.add_argument("--prompt", required=True, metavar="TEXT", help="the text to complete")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as a user message through the chat template")
    add_sampling_arguments(parser, max_new_tokens=128)
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from hybridmoe.commands.doctor import print_choices
    from hybridmoe.llm import LLM

    llm = LLM(args.model, **engine_kwargs(args))
    params = sampling_params(args)
    prompt = llm.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else llm.encode(args.prompt)
    start = time.perf_counter()
    first = None
    out = None
    for out in llm.stream(prompt, params):
        if first is None:  # here, not before: a request the engine refuses stays a one-line error
            first = time.perf_counter()
            print_choices(llm.engine)
        sys.stdout.write(out.new_text)
        sys.stdout.flush()
    end = time.perf_counter()
    sys.stdout.write("\n")
    n = len(out.token_ids)
    decode_rate = (n - 1) / (end - first) if n > 1 and end > first else 0.0
    print(f"[{n} tokens, {out.finish_reason}; first token {1000 * (first - start):.0f} ms, "
          f"{decode_rate:.1f} tok/s after]", file=sys.stderr)
    if out.error is not None:
        print(f"error: the generation failed: {out.error}", file=sys.stderr)
        return 1
    return 0
