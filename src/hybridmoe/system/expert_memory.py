"""Whether this machine's memory holds the routed experts a load is about to pack for the CPU.

A model whose packed experts exceed the memory would end, after a load of maybe hours, in the kernel's
OOM killer. So before the first expert is read, their packed size (every CPU expert of every MoE layer,
padding included) is set against MemTotal, an error, and MemAvailable, a warning; both name the formats
that would fit. Experts mapped from a converted directory or the expert cache are file pages the kernel
can drop and read again, so such loads are not checked.
"""

from __future__ import annotations

import warnings

from hybridmoe.config import EngineConfig, format_bytes
from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.streamed_prefill import layer_packed_bytes
from hybridmoe.system.host import meminfo
from hybridmoe.weights.native_format import fitting_int4_group

_SMALLER = {"bf16": ("int8", "int4"), "int8": ("int4",), "int4": (), "fp8": ("int4",), "mxfp4": ()}
"""The formats to name when one does not fit (mxfp4 takes the bytes of int4 g128: nothing smaller)."""


def packed_bytes(fmt: str, cpu_experts: list[int], hidden: int, inter: int, group_size: int,
                 zero_points: bool) -> int:
    """Bytes of the packed CPU experts: cpu_experts[i] experts of [inter, hidden] in the i-th MoE layer."""
    return sum(layer_packed_bytes(fmt, n, hidden, inter, group_size, zero_points) for n in cpu_experts if n)


def _fits(ec: EngineConfig, cpu_experts: list[int], hidden: int, inter: int) -> tuple[int, int, int, str]:
    """(bytes the packed CPU experts take, MemTotal, MemAvailable, what would fit instead)."""
    total, available = meminfo()
    zero_points = bool(ec.expert_zero_points)
    need = packed_bytes(ec.expert_format, cpu_experts, hidden, inter, ec.expert_group_size, zero_points)
    fits = []
    for fmt in _SMALLER[ec.expert_format]:
        group = ec.expert_group_size if fmt != "int4" else fitting_int4_group(ec.expert_group_size, hidden, inter)
        n = packed_bytes(fmt, cpu_experts, hidden, inter, group, zero_points) if group else available + 1
        if n <= available:
            group_flag = f" --expert-group-size {group}" if group != ec.expert_group_size else ""
            flags = f"--expert-format {fmt}{group_flag}"
            fits.append(f"expert_format {fmt} ({flags}: {format_bytes(n)})")
    fix = "use " + " or ".join(fits) if fits else "no expert format fits"
    if ec.device.startswith("cuda"):
        fix += ", or a GPU memory budget (--gpu-memory-budget) that holds more of them on the GPU"
    return need, total, available, fix


def check_expert_memory(ec: EngineConfig, cpu_experts: list[int], hidden: int, inter: int) -> None:
    """ec resolved (the native engine's format); cpu_experts: the CPU's experts in each MoE layer."""
    need, total, available, fix = _fits(ec, cpu_experts, hidden, inter)
    if total == 0 or need <= available:  # total 0: no /proc/meminfo, nothing to check against
        return
    what = f"the routed experts packed for the CPU in {ec.expert_format} take {format_bytes(need)}"
    if need > total:
        raise HybridMoEError(f"{what}, more than this machine's {format_bytes(total)} of memory; {fix}")
    warnings.warn(f"{what}, more than the {format_bytes(available)} of memory available now; the load may "
                  f"swap or be killed; {fix}", stacklevel=3)


def memory_line(ec: EngineConfig, cpu_experts: list[int], hidden: int, inter: int) -> str:
    """`hybridmoe doctor`'s line: the packed CPU experts against the memory, and what fits if they do not."""
    need, total, available, fix = _fits(ec, cpu_experts, hidden, inter)
    line = (f"memory:     the CPU's routed experts in {ec.expert_format}: {format_bytes(need)} of "
            f"{format_bytes(available)} available ({format_bytes(total)} total)")
    return line if need <= available or total == 0 else f"{line}; too large: {fix}"
