"""Decode-step benchmarks: its GPU kernels per layer (fused paths side by side), its parts outside the layers
(the runner's host paths), its CPU expert calls traced in the pipeline and replayed standalone, deferred
experts switched on one engine, and `hybridmoe doctor`'s decode estimate against `hybridmoe bench`.

    python3 benchmarks/decode.py COMMAND [options]      (python3 benchmarks/decode.py COMMAND --help)
"""

from __future__ import annotations

import sys

if __package__:
    from .lib import cpu_trace, deferral_decode, doctor_estimate, gpu_ops, step_parts
    from .lib.cli import main as run_command
else:
    from lib import cpu_trace, deferral_decode, doctor_estimate, gpu_ops, step_parts
    from lib.cli import main as run_command

COMMANDS = {"gpu-ops": gpu_ops, "step-parts": step_parts, "cpu-trace": cpu_trace, "deferral": deferral_decode,
            "estimate": doctor_estimate}


def main(argv: list[str] | None = None) -> int:
    return run_command("decode.py", __doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
