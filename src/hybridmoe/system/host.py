"""Host facts: CPU model and ISA, cores, NUMA nodes, RAM, GPU. Read from the kernel and torch, measured nowhere."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

ISA_FLAGS = ("amx_bf16", "amx_int8", "amx_tile", "avx512_bf16", "avx512_vnni", "avx512_fp16", "avx512f", "avx2")


@dataclass
class GpuInfo:
    name: str
    total_bytes: int
    free_bytes: int


@dataclass
class HostInfo:
    cpu_model: str
    isa: dict[str, bool] | None
    """cpuid flags from the native engine (hybridmoe._native.cpu_features), None if it is not built."""
    kernel_paths: list[str]
    """The native engine's kernel paths this CPU runs (generic, avx2, avx512, amx)."""
    online_cpus: int
    allowed_cpus: int
    physical_cores: int | None
    numa_nodes: int
    ram_total_bytes: int
    ram_available_bytes: int
    gpus: list[GpuInfo]


def _cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    m = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    return m.group(1).strip() if m else "unknown"


def _physical_cores() -> int | None:
    """Distinct (package, core) pairs in /sys (SMT siblings counted once)."""
    cores = set()
    for topo in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology"):
        try:
            cores.add(((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip()))
        except OSError:
            continue
    return len(cores) or None


def count_cpu_list(text: str) -> int:
    """Entries of a kernel CPU/node list like "0-3,8,10-11"."""
    n = 0
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        n += int(hi or lo) - int(lo) + 1
    return n


def numa_nodes(sys_root: Path = Path("/sys/devices/system/node")) -> int:
    try:
        return max(1, count_cpu_list((sys_root / "online").read_text()))
    except (OSError, ValueError):
        return 1


def meminfo(path: Path = Path("/proc/meminfo")) -> tuple[int, int]:
    """(MemTotal, MemAvailable) in bytes."""
    values = {}
    try:
        for line in path.read_text().splitlines():
            key, _, rest = line.partition(":")
            values[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return 0, 0
    return values.get("MemTotal", 0), values.get("MemAvailable", values.get("MemFree", 0))


def gpus() -> list[GpuInfo]:
    import torch

    found = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            found.append(GpuInfo(torch.cuda.get_device_name(i), total, free))
    return found


def host_info() -> HostInfo:
    try:
        from hybridmoe import _native

        isa = {k: bool(v) for k, v in _native.cpu_features().items()}
        paths = list(_native.available_isas())
    except ImportError:
        isa, paths = None, []
    try:
        online = count_cpu_list(Path("/sys/devices/system/cpu/online").read_text())
    except (OSError, ValueError):
        online = os.cpu_count() or 1
    total, available = meminfo()
    return HostInfo(cpu_model=_cpu_model(), isa=isa, kernel_paths=paths, online_cpus=online,
                    allowed_cpus=len(os.sched_getaffinity(0)), physical_cores=_physical_cores(),
                    numa_nodes=numa_nodes(), ram_total_bytes=total, ram_available_bytes=available, gpus=gpus())
