"""`hybridmoe run --model PATH --prompt TEXT`: complete one prompt, streaming the text to stdout.

Only the completion goes to stdout; the engine's choices (doctor's line) and a one-line summary
(tokens, speed) go to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time

from hybridmoe.commands.engine_args import add_engine_arguments, add_model_argument, engine_kwargs
from hybridmoe.commands.sampling_args import add_sampling_arguments, sampling_params


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = add_model_argument(parser)
    prompt = parser.add_argument_group("prompt")
    prompt.add_argument("--prompt", required=True, metavar="TEXT", help="the text to complete")
    prompt.add_argument("--chat", action="store_true",
                        help="send the prompt as a user message through the chat template (default: off)")
    add_sampling_arguments(parser)
    add_engine_arguments(parser, model)


def run(args: argparse.Namespace) -> int:
    from hybridmoe.commands.doctor import print_choices
    from hybridmoe.llm import LLM

    llm = LLM(args.model, **engine_kwargs(args))
    prompt = llm.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else llm.encode(args.prompt)
    params = sampling_params(args, room=llm.engine.max_model_len - len(prompt))
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
    print(summary_line(out, start, first, end), file=sys.stderr)
    if out.error is not None:
        print(f"error: the generation failed: {out.error}", file=sys.stderr)
        return 1
    return 0


def summary_line(out, start: float, first: float, end: float, finish: str | None = None) -> str:
    """[tokens, finish reason (or finish); time to the first token, decode speed after it], as run and chat
    print it."""
    n = len(out.token_ids)
    decode_rate = (n - 1) / (end - first) if n > 1 and end > first else 0.0
    return (f"[{n} tokens, {finish or out.finish_reason}; first token {1000 * (first - start):.0f} ms, "
            f"{decode_rate:.1f} tok/s after]")
