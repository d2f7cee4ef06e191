"""fixed_cpu_slots: a token's CPU slots as a dense [T, width] in fixed shapes, as the CUDA handoff
stages them. The native engine, run as its host functions run it (no CUDA here), gives with them
what CpuExperts.forward gives with compact_slots' distinct ids.

T tokens, K experts per token, E experts of the layer, C of them on the CPU, H hidden, I intermediate.
"""

import hybridmoe._native as native
import pytest
import torch

from hybridmoe import CpuExperts
from hybridmoe.experts.cpu_slots import compact_slots
from hybridmoe.experts.decode_fused import fixed_cpu_slots

E, H, I, K = 8, 64, 32, 3
ON_GPU = torch.tensor([True, False, True, False, False, True, False, False])  # C = 5 on the CPU
LOCAL = torch.tensor([0, 0, 1, 1, 2, 2, 3, 4])  # global id -> index among its side's experts


def routing(T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[0] = torch.tensor([0, 2, 5])  # a token whose experts are all on the GPU
    return ids, torch.rand(T, K, generator=g)


@pytest.mark.parametrize("T", [1, 4])
def test_fixed_cpu_slots_keep_every_cpu_slot_and_pad_with_weight_zero(T):
    ids, w = routing(T, seed=T)
    keep = ~ON_GPU[ids]
    cids, cw = fixed_cpu_slots(LOCAL[ids], w, keep, K)
    assert cids.shape == cw.shape == (T, K)
    assert bool(((cids >= 0) & (cids < int((~ON_GPU).sum()))).all())
    for t in range(T):
        want = sorted((int(LOCAL[e]), float(x)) for e, x, k in zip(ids[t], w[t], keep[t]) if k)
        got = sorted((int(e), float(x)) for e, x in zip(cids[t], cw[t]) if x != 0)
        assert got == want
        if want:  # padding repeats the token's own expert: no other expert's weights are read
            assert set(cids[t].tolist()) == {e for e, _ in want}


def test_native_engine_with_fixed_slots_equals_forward_with_distinct_ids():
    C, T = int((~ON_GPU).sum()), 4
    g = torch.Generator().manual_seed(0)
    ex = CpuExperts(torch.randn(C, I, H, generator=g) / H**0.5, torch.randn(C, I, H, generator=g) / H**0.5,
                    torch.randn(C, H, I, generator=g) / I**0.5, format="bf16", threads=2)
    ids, w = routing(T, seed=7)
    keep = ~ON_GPU[ids]
    x = torch.randn(T, H, generator=g)
    cids, cw = fixed_cpu_slots(LOCAL[ids], w, keep, K)
    x_s, ids_s, w_s, out = x.clone(), cids.clone(), cw.clone(), torch.zeros(T, H)
    handoff = native.CudaHandoff(T, K)
    st = ex.packed_state()
    layer = handoff.add_layer(C, H, I, st["format"], st["group_size"], st["zero_points"], ex.threads, ex.isa,
                              st["numa_nodes"], st["buffers"], x_s, ids_s, w_s, out)
    handoff.run([layer], T)
    assert handoff.take_error() is None
    want = ex.forward(x.clone(), *compact_slots(LOCAL[ids], w, keep))
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
