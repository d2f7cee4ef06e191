"""The AMX path (many-token experts) on a CPU that has it; run by scripts/device_check.sh.

Experts with >= 16 tokens run AMX BF16 tiles, the others the AVX-512 kernels: these tests mix
both within one call and hold AMX against the reference on the weights the kernels hold.
"""

import os
import statistics
import time

import pytest
import torch

from hybridmoe import CpuExperts
from hybridmoe.experts.cpu_experts import available_isas
from hybridmoe.experts.torch_ref import ref_moe

pytestmark = [pytest.mark.device,
              pytest.mark.skipif("amx" not in available_isas(), reason="this CPU has no usable AMX")]

E, H, I, K = 8, 192, 96, 2
# AMX rounds activations (and int4 dequantized weights) to bf16: up to ~0.5% more than AVX-512;
# its int8 reads int8 activations (AMX-INT8): ~1.5-1.85% (tests/kernels/conftest.py).
KERNEL_TOL = {"bf16": 0.008, "int8": 0.02, "int4": 0.01, "mxfp4": 0.008}


def layer(fmt, isa, E=E, H=H, I=I):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(E, I, H, generator=g) / H**0.5, torch.randn(E, I, H, generator=g) / H**0.5,
         torch.randn(E, H, I, generator=g) / I**0.5)
    return CpuExperts(*w, format=fmt, group_size=32, isa=isa)


@pytest.mark.parametrize("T", [16, 17, 64, 300])
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4", "mxfp4"])
def test_amx_matches_reference_on_held_weights(fmt, T):
    experts = layer(fmt, "amx")
    deq = [torch.stack(p) for p in zip(*[experts.dequantized(e) for e in range(E)])]
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g)
    # Expert 0 takes every token (AMX); the second choice spreads over the rest (mixed paths).
    ids = torch.stack([torch.tensor([0, 1 + int(torch.randint(E - 1, (1,), generator=g))]) for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    ref = ref_moe(x, *deq, ids, w)
    out = experts.forward(x, ids, w)
    assert ((out - ref).norm() / ref.norm()).item() < KERNEL_TOL[fmt]
    avx = layer(fmt, "avx512").forward(x, ids, w)
    assert ((out - avx).norm() / avx.norm()).item() < KERNEL_TOL[fmt]


@pytest.mark.parametrize("h, i", [(H, I), (2048, 320)])
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4", "mxfp4"])
def test_amx_equals_its_emulation(fmt, h, i):
    # The CPU tests check amx_kernels.inc through the emulated tiles; this holds the real
    # instructions to the emulation (only fp32 summation order may differ). H 2048: several K
    # chunks; I 320: int8's h in three scale groups, the last one partial.
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, h, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(300)])
    w = torch.rand(300, K, generator=g)
    out = layer(fmt, "amx", H=h, I=i).forward(x, ids, w)
    emu = layer(fmt, "amx_emulated", H=h, I=i).forward(x, ids, w)
    assert ((out - emu).norm() / emu.norm()).item() < 1e-4


def test_every_core_busy_never_stalls():
    # kt-kernel busy-waits and takes multiples of ~8 ms per call with 16 threads on 16 cores;
    # ours spins briefly then sleeps, so the feeding thread always gets a core.
    threads = len(os.sched_getaffinity(0))
    experts = CpuExperts(*(torch.randn(16, 512, 1024), torch.randn(16, 512, 1024), torch.randn(16, 1024, 512)),
                         format="int4", threads=threads)
    x, ids, w = torch.randn(1, 1024), torch.arange(8).reshape(1, 8), torch.rand(1, 8)
    times = []
    for _ in range(300):
        t0 = time.perf_counter()
        experts.forward(x, ids, w)
        times.append(time.perf_counter() - t0)
    assert statistics.median(times) < 2e-3 and sorted(times)[-3] < 8e-3
