"""Structured output's cost (issue #28): decode tok/s with and without a JSON-schema grammar at batch 1 and 8,
the mask's own time per token, and the time to compile a large schema.

    python3 benchmarks/structured.py {decode,compile} [options]     (python3 benchmarks/structured.py decode --help)
"""

from __future__ import annotations

import sys

if __package__:
    from .lib import structured_bench
    from .lib.cli import main as run_command
else:
    from lib import structured_bench
    from lib.cli import main as run_command

COMMANDS = {"decode": structured_bench, "compile": structured_bench}


def main(argv: list[str] | None = None) -> int:
    return run_command("structured.py", __doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
