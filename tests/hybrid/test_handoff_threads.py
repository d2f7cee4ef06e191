"""How many workers the CUDA handoff's layers get: the CPU experts' own count, but one CPU stays
free for the thread that drives the GPU."""

import hybridmoe._native as native
import pytest
import torch

from hybridmoe import CpuExperts
from hybridmoe.experts.cuda_handoff import handoff_threads


@pytest.mark.parametrize("threads, cpus, expected", [
    (16, 16, 15),  # every CPU taken: one given back
    (15, 16, 15),  # one already free
    (4, 16, 4),
    (32, 16, 15),  # more workers than CPUs
    (1, 1, 1),     # a single CPU: nothing to give back
    (2, 2, 1),
])
def test_handoff_leaves_one_cpu_free(threads, cpus, expected):
    assert handoff_threads(threads, cpus) == expected


def test_a_layer_with_fewer_workers_computes_what_its_cpu_experts_do():
    """The handoff's pool may be smaller than the CpuExperts' own: same packed weights, same
    result, bit for bit (the work items do not depend on the number of workers)."""
    E, H, I, K, T = 16, 128, 64, 4, 5
    g = torch.Generator().manual_seed(0)
    ex = CpuExperts(torch.randn(E, I, H, generator=g) / H**0.5, torch.randn(E, I, H, generator=g) / H**0.5,
                    torch.randn(E, H, I, generator=g) / I**0.5, format="int4", group_size=32, threads=2)
    x, ids = torch.zeros(T, H, dtype=torch.bfloat16), torch.zeros(T, K, dtype=torch.int64)
    w, out = torch.zeros(T, K), torch.zeros(T, H, dtype=torch.bfloat16)
    st = ex.packed_state()
    handoff = native.CudaHandoff(T, K)
    handoff.add_layer(E, H, I, st["format"], st["group_size"], st["zero_points"], handoff_threads(ex.threads, 2),
                      ex.isa, st["numa_nodes"], st["buffers"], x, ids, w, out)
    x[:] = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids[:] = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w[:] = torch.rand(T, K, generator=g)
    handoff.run([0], T)
    assert torch.equal(out, ex.forward(x.clone(), ids.clone(), w.clone()))
