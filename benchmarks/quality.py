"""Quality benchmarks: what the expert formats cost in accuracy (a layer's error, the next-token KL), what
deferred experts cost (KL and greedy agreement against none), and how many of a layer's experts its router
names from the layer's input (a prefetch's prediction).

    python3 benchmarks/quality.py COMMAND [options]     (python3 benchmarks/quality.py COMMAND --help)
"""

from __future__ import annotations

import sys

if __package__:
    from .lib import deferral_quality, formats_quality, route_prediction
    from .lib.cli import main as run_command
else:
    from lib import deferral_quality, formats_quality, route_prediction
    from lib.cli import main as run_command

COMMANDS = {"formats": formats_quality, "deferral": deferral_quality, "route-prediction": route_prediction}


def main(argv: list[str] | None = None) -> int:
    return run_command("quality.py", __doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
