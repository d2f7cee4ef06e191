"""`hybridmoe <command>`: one module per command under hybridmoe/commands/.

Each command module defines `add_arguments(parser)` and `run(args) -> int`, and imports
heavy things (torch, the model) inside run() so that `--help` answers at once.
User mistakes (HybridMoEError) print as one line, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from importlib import import_module

from hybridmoe.errors import HybridMoEError

COMMANDS = {
    "make-model": ("hybridmoe.commands.make_model", "write a random-weight Hugging Face checkpoint"),
    "run": ("hybridmoe.commands.run", "complete one prompt, streaming to stdout"),
    "chat": ("hybridmoe.commands.chat", "interactive multi-turn chat"),
    "serve": ("hybridmoe.commands.serve", "OpenAI- and Ollama-compatible HTTP server with a web chat page"),
    "bench": ("hybridmoe.commands.bench", "end-to-end prefill/decode speed, time to first token, load time, peak RSS"),
    "convert": ("hybridmoe.commands.convert", "pack a checkpoint's routed experts for the native engine, once"),
    "doctor": ("hybridmoe.commands.doctor", "this machine's CPU, GPU and bandwidths, and what a run would choose"),
    "profile-experts": ("hybridmoe.commands.profile_experts", "record how often each routed expert is chosen"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridmoe",
        description="Run Mixture-of-Experts LLMs larger than the GPU: routed experts on the CPU.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        mod = import_module(module)
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args._run(args) or 0
    except HybridMoEError as e:
        print(f"hybridmoe {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
