"""Long context and prefix reuse (issue #27): decode tok/s at 1K to 128K tokens of context, the time to first
token of a re-sent conversation against its cold one, the most context a GPU budget holds, the float8 cache's
accuracy.

    python3 benchmarks/context.py {decode,prefix,fit,fp8} [options]     (python3 benchmarks/context.py decode --help)
"""

from __future__ import annotations

import sys

if __package__:
    from .lib import context_bench
    from .lib.cli import main as run_command
else:
    from lib import context_bench
    from lib.cli import main as run_command

COMMANDS = {"decode": context_bench, "prefix": context_bench, "fit": context_bench, "fp8": context_bench}


def main(argv: list[str] | None = None) -> int:
    return run_command("context.py", __doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
