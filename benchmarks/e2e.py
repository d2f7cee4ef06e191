"""End-to-end speed at batch 1 against the decode floor (issue #4's tables): prefill tok/s per prompt length,
time to first token, decode tok/s, peak GPU memory and RSS, with ablation rows on the same engine and
full-depth figures from cut models; `suite` runs the issue's preset configurations.

    python3 benchmarks/e2e.py COMMAND [options]     (python3 benchmarks/e2e.py COMMAND --help)
"""

from __future__ import annotations

import sys

if __package__:
    from .lib import e2e, e2e_suite
    from .lib.cli import main as run_command
else:
    from lib import e2e, e2e_suite
    from lib.cli import main as run_command

COMMANDS = {"run": e2e, "suite": e2e_suite}


def main(argv: list[str] | None = None) -> int:
    return run_command("e2e.py", __doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
