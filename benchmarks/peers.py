"""Peers measured side by side on the same host and the same shapes (issue #26): llama.cpp (built from the
sources llama-cpp-python vendors) against our engine on the same GGUF file and from safetensors, and
kt-kernel's CPU MoE layer against ours; every comparison one table with both figures, their ratio and the
decode floor measured in the same run.

    python3 benchmarks/peers.py COMMAND [options]     (python3 benchmarks/peers.py COMMAND --help)

`sources` runs on a machine with the sdist and the wheel (it writes .peers/); the others on the GPU host,
which needs nothing but .peers/ (carried) and the project's own environment. docs/benchmarks.md gives the
device calls.
"""

from __future__ import annotations

import sys

if __package__:
    from .lib import peers_all, peers_build, peers_kt, peers_llama, peers_sources
    from .lib.cli import main as run_command
else:
    from lib import peers_all, peers_build, peers_kt, peers_llama, peers_sources
    from lib.cli import main as run_command

COMMANDS = {"sources": peers_sources, "build": peers_build, "llama": peers_llama, "kt": peers_kt,
            "all": peers_all}


def main(argv: list[str] | None = None) -> int:
    return run_command("peers.py", __doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
