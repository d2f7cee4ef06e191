"""Kernel benchmarks: one MoE layer's CPU experts (against torch and the host's read bandwidth), their trace
and call cost, the GPU's expert and GEMV kernels, the CPU/GPU handoff, and the C++ micro-benchmarks of the
decode kernels (built from the repo's sources first).

    python3 benchmarks/kernel.py COMMAND [options]     (python3 benchmarks/kernel.py COMMAND --help)
"""

from __future__ import annotations

import sys

if __package__:
    from .lib import (amx_tile, call_overhead, engine_loop, gemv, gpu_experts, handoff, int8_error, kernel_rate,
                      moe_layer, moe_trace, prefetch_gain, prefill_sweep)
    from .lib.cli import main as run_command
else:
    from lib import (amx_tile, call_overhead, engine_loop, gemv, gpu_experts, handoff, int8_error, kernel_rate,
                     moe_layer, moe_trace, prefetch_gain, prefill_sweep)
    from lib.cli import main as run_command

COMMANDS = {
    "moe-layer": moe_layer,
    "prefill-sweep": prefill_sweep,
    "trace": moe_trace,
    "call-overhead": call_overhead,
    "prefetch": prefetch_gain,
    "int8-error": int8_error,
    "gpu-experts": gpu_experts,
    "gemv": gemv,
    "handoff": handoff,
    "kernel-rate": kernel_rate,
    "engine-loop": engine_loop,
    "amx-tile": amx_tile,
}


def main(argv: list[str] | None = None) -> int:
    return run_command("kernel.py", __doc__, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
