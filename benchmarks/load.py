"""Load benchmarks: peak resident memory while loading and packing one layer's experts (each format in a
fresh process, against the issue's target), and the time of a cold start, a start from the expert cache
and from a converted directory.

    python3 benchmarks/load.py COMMAND [options]    (python3 benchmarks/load.py COMMAND --help)
"""

from __future__ import annotations

import sys

if __package__:
    from .lib import load_rss, load_time
    from .lib.cli import main as run_command
else:
    from lib import load_rss, load_time
    from lib.cli import main as run_command

COMMANDS = {"rss": load_rss, "time": load_time}


def main(argv: list[str] | None = None) -> int:
    return run_command("load.py", __doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
