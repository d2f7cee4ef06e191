"""The engine's own packed buffers are advised for transparent huge pages (decode streams them)."""

from pathlib import Path

import pytest
import torch

from hybridmoe import CpuExperts

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def anon_huge_kib(address):
    """AnonHugePages (KiB) of the mapping of this process that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="transparent huge pages are off")
def test_packed_weights_get_huge_pages():
    # bf16 gate buffer: 4 experts x 1024 x 2048 x 2 bytes = 16 MiB, eight 2 MiB pages and more
    E, H, I = 4, 2048, 1024
    w = torch.randn(E, I, H) / 45, torch.randn(E, I, H) / 45, torch.randn(E, H, I) / 32
    experts = CpuExperts(*w, format="bf16", threads=1)
    gate = experts.packed_state()["buffers"]["gate.0.w"]
    assert anon_huge_kib(gate.ctypes.data) >= 2048
