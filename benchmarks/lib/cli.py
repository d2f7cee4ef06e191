"""The entry points' command line: one subcommand per benchmark module.

A benchmark module defines `add_arguments(parser)` and `run(args) -> int`; its docstring is the
subcommand's help (first line) and description. Every subcommand takes `--json FILE` (write_json writes
the results there when given). A HybridMoEError is a one-line error (exit 2); SIGTERM (a `timeout`)
raises Stopped, so that a run unwinds (its in-memory checkpoint deleted) and may print what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from types import ModuleType

from hybridmoe.errors import HybridMoEError


class Stopped(BaseException):
    """SIGTERM: not an Exception, so no per-row retry catches it; a benchmark that can prints what it has."""


def _stop(signum, frame):
    raise Stopped


def parser(prog: str, description: str, commands: dict[str, ModuleType]) -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog=prog, description=description,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in commands.items():
        doc = (module.__doc__ or "").strip()
        summary = " ".join(doc.split("\n\n")[0].split())  # the docstring's first paragraph
        p = sub.add_parser(name, help=summary, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.add_argument("--json", metavar="FILE", help="also write the results here as JSON")
        p.set_defaults(run=module.run)
    return top


def main(prog: str, description: str, commands: dict[str, ModuleType], argv: list[str] | None = None) -> int:
    """Parse argv (default: sys.argv[1:]) and run the subcommand it names; its exit status."""
    args = parser(prog, description, commands).parse_args(argv)
    before = signal.signal(signal.SIGTERM, _stop)
    try:
        return args.run(args) or 0
    except HybridMoEError as e:
        print(f"{prog} {args.command}: error: {e}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, before)


def write_json(path: str | None, data) -> None:
    """data as indented JSON into path (its folder made), if a path is given; what JSON cannot hold as str."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)
        f.write("\n")


def int_list(text: str) -> list[int]:
    """"1,4,64" -> [1, 4, 64] (blanks between the commas allowed)."""
    return [int(v) for v in str(text).split(",") if v.strip()]


def str_list(text: str | None) -> list[str]:
    """"int4, bf16" -> ["int4", "bf16"]; None or "" -> []."""
    return [v.strip() for v in text.split(",") if v.strip()] if text else []


def options(args) -> dict:
    """The subcommand's options as given, for its JSON (without the function argparse dispatches to)."""
    return {k: v for k, v in vars(args).items() if k != "run"}
