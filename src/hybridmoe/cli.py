"""`hybridmoe <command>`: one module per command under hybridmoe/commands/.

Each command module defines `add_arguments(parser)` and `run(args) -> int`, and imports
heavy things (torch, the model) inside run() so that `--help` answers at once; main() imports
only the module of the command it runs. User mistakes (HybridMoEError) print as one line,
never a traceback.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
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
    "finetune": ("hybridmoe.commands.finetune", "train a LoRA adapter on chat data, routed experts on the CPU"),
}


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's, with the help column a little further left and flags never cut at their hyphens."""

    def __init__(self, prog: str):
        super().__init__(prog, max_help_position=30)

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole CLI; with only, the arguments of that one command alone (the others, or with "" all of
    them, stay bare names)."""
    parser = argparse.ArgumentParser(
        prog="hybridmoe",
        description="Run Mixture-of-Experts LLMs larger than the GPU: routed experts on the CPU.",
        formatter_class=_HelpFormatter)
    parser.add_argument("--version", action=_VersionAction, help="the versions of hybridmoe and torch, and "
                        "whether the native expert engine is built")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, formatter_class=_HelpFormatter)
        if only is None or only == name:
            mod = import_module(module)
            mod.add_arguments(p)
            p.usage = _usage(p)
            p.set_defaults(_run=mod.run)
    return parser


def _usage(parser: argparse.ArgumentParser) -> str:
    """`hybridmoe run --model PATH --prompt TEXT [options]`: the required flags, then the rest in one word."""
    required = [f"{a.option_strings[0]} {a.metavar or a.dest.upper()}" for a in parser._actions
                if a.required and a.option_strings]
    return " ".join(["%(prog)s", *required, "[options]"])


class _VersionAction(argparse.Action):
    """--version: the text is made only when asked for, since it loads the native engine."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


def version_text() -> str:
    """`hybridmoe 0.1.0` and a line with torch's version and whether the native engine is built."""
    from importlib.metadata import PackageNotFoundError, version

    from hybridmoe.platform import native_engine_built

    try:
        ours = version("hybridmoe")
    except PackageNotFoundError:  # run from a source tree that was never installed
        ours = "(not installed)"
    try:
        torch = f"torch {version('torch')}"
    except PackageNotFoundError:
        torch = "torch not installed"
    engine = "built" if native_engine_built() else "not built (experts run in torch)"
    return f"hybridmoe {ours}\n{torch}, native expert engine {engine}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command if command in COMMANDS else "").parse_args(argv)
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
