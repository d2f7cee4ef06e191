"""`hybridmoe doctor` on a GPU host prints the PCIe bandwidth the streaming choice uses: one measurement per
process, not one of its own beside it. (On this CPU-only machine the GPU and the copy are stand-ins.)"""

import dataclasses
import re

import pytest
import torch

import hybridmoe.system.bandwidth as bandwidth
import hybridmoe.system.host as host
from hybridmoe.cli import main
from hybridmoe.system.auto import measured_pcie_bandwidth


@pytest.fixture
def one_gpu(monkeypatch):
    """A host with one GPU whose pinned copies measure 1, 2, 3 ... GB/s in turn; -> the sizes copied."""
    copies = []

    def h2d(device, nbytes, repeats=5):
        copies.append(nbytes)
        return len(copies) * 1e9

    gpu = host.GpuInfo("stand-in", 16 << 30, 16 << 30)
    real = host.host_info
    monkeypatch.setattr(host, "host_info", lambda: dataclasses.replace(real(), gpus=[gpu]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bandwidth, "pinned_h2d_bandwidth", h2d)
    monkeypatch.setattr(bandwidth, "device_copy_bandwidth", lambda device, nbytes, repeats=5: 1000e9)
    measured_pcie_bandwidth.cache_clear()
    yield copies
    measured_pcie_bandwidth.cache_clear()


def test_doctor_prints_the_pcie_figure_the_streaming_choice_uses(tiny_checkpoints, one_gpu, capsys):
    path = tiny_checkpoints("qwen3_moe")
    assert main(["doctor", "--model", str(path), "--measure-bytes", "16MiB", "--device", "cuda",
                 "--gpu-memory-budget", "1GiB", "--gpu-experts-per-layer", "1", "--expert-backend", "native",
                 "--expert-format", "int4"]) == 0
    out = capsys.readouterr().out
    printed = re.search(r"pcie h2d: +([\d.]+) GB/s", out).group(1)
    used = re.search(r"streaming: .* PCIe at ([\d.]+) GB/s", out).group(1)
    assert printed == used == "1.0" and len(one_gpu) == 1, out
