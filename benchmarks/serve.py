"""Server benchmarks: streamed completions against a running server at several concurrency levels (against
concurrency 1, measured in the same run), and a bounded soak run of mixed requests against a server it starts.

    python3 benchmarks/serve.py COMMAND [options]   (python3 benchmarks/serve.py COMMAND --help)
"""

from __future__ import annotations

import sys

if __package__:
    from .lib import serve, soak
    from .lib.cli import main as run_command
else:
    from lib import serve, soak
    from lib.cli import main as run_command

COMMANDS = {"throughput": serve, "soak": soak}


def main(argv: list[str] | None = None) -> int:
    return run_command("serve.py", __doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
