"""Prefill benchmarks: one prefill step's time per layer and part, with PCIe streaming of the experts on and
off in one engine, and a layer's experts streamed to the GPU against the CPU engine.

    python3 benchmarks/prefill.py COMMAND [options]     (python3 benchmarks/prefill.py COMMAND --help)
"""

from __future__ import annotations

import sys

if __package__:
    from .lib import prefill_profile, streamed_prefill
    from .lib.cli import main as run_command
else:
    from lib import prefill_profile, streamed_prefill
    from lib.cli import main as run_command

COMMANDS = {"profile": prefill_profile, "streamed": streamed_prefill}


def main(argv: list[str] | None = None) -> int:
    return run_command("prefill.py", __doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
