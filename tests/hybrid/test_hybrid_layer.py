"""One MoE layer split between the "GPU" (here the CPU stands in) and the CPU engine equals the reference."""

import pytest
import torch

from hybridmoe.experts.cpu_experts import CpuExperts
from hybridmoe.experts.cpu_slots import compact_slots
from hybridmoe.experts.expert_bytes import cpu_expert_bytes
from hybridmoe.experts.hybrid import HybridExperts, TorchCpuLayer
from hybridmoe.experts.placement import Footprint, PlacementPlan
from hybridmoe.experts.torch_ref import ref_moe

E, H, I, K = 8, 64, 32, 3  # experts, hidden, intermediate, experts per token
BF16 = dict(atol=5e-2, rtol=5e-2)


def plan_with(gpu_ids: list[int]) -> PlacementPlan:
    fp = Footprint(0, 0, 0, 3 * I * H * 4, [0], E, K, H, I)
    return PlacementPlan(fp, None, "test", {0: gpu_ids} if gpu_ids else {})


def cpu_layer(kind):
    if kind == "native":
        return lambda g, u, d: CpuExperts(g, u, d, format="bf16", threads=1)
    return TorchCpuLayer


def layer_inputs(T: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weights = (torch.randn(E, I, H, generator=g) / 8, torch.randn(E, I, H, generator=g) / 8,
               torch.randn(E, H, I, generator=g) / 6)
    x = torch.randn(T, H, generator=g)
    scores = torch.randn(T, E, generator=g).softmax(-1)
    w, ids = scores.topk(K, dim=-1)
    return weights, x, ids, w


@pytest.mark.parametrize("gpu_ids", [[], [7], [0, 3, 5], list(range(E))])
@pytest.mark.parametrize("T", [1, 6])
@pytest.mark.parametrize("kind", ["torch", "native"])
def test_split_layer_equals_the_reference(gpu_ids, T, kind):
    weights, x, ids, w = layer_inputs(T)
    backend = HybridExperts(plan_with(gpu_ids), "cpu", cpu_layer(kind))
    backend.set_layer(0, *weights)
    got = backend.forward(0, x, ids, w)
    want = ref_moe(x, *weights, ids, w)
    torch.testing.assert_close(got, want, **(BF16 if kind == "native" else dict(atol=1e-5, rtol=1e-5)))


@pytest.mark.parametrize("kind", ["torch", "native"])
def test_the_cpu_engine_holds_only_the_experts_not_on_the_gpu(kind):
    weights, *_ = layer_inputs(1)
    backend = HybridExperts(plan_with([1, 4, 6]), "cpu", cpu_layer(kind))
    backend.set_layer(0, *weights)
    engine = backend.cpu_engine(0)
    assert engine.num_experts == E - 3
    if kind == "native":
        assert engine.packed_bytes == (E - 3) * cpu_expert_bytes("bf16", I, H, 128)
        # the CPU engine's expert 0..4 are global experts 0, 2, 3, 5, 7 in order
        torch.testing.assert_close(engine.dequantized(2)[0], weights[0][3].bfloat16().float())
    every = HybridExperts(plan_with(list(range(E))), "cpu", cpu_layer(kind))
    every.set_layer(0, *weights)
    assert every.cpu_engine(0) is None


def test_compacted_rows_keep_their_slots_and_pad_with_distinct_batch_experts():
    ids = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 1, 0]])
    w = torch.tensor([[0.5, 0.3, 0.2], [0.4, 0.4, 0.2], [0.6, 0.3, 0.1]])
    keep = torch.tensor([[True, False, False], [True, True, True], [False, True, False]])
    cids, cw = compact_slots(ids, w, keep)
    assert cids.shape == (3, 3)
    active = set(ids[keep].tolist())
    for t in range(3):
        kept = ids[t][keep[t]].tolist()
        assert cids[t, :len(kept)].tolist() == kept and cw[t, :len(kept)].tolist() == w[t][keep[t]].tolist()
        assert len(set(cids[t].tolist())) == 3 and set(cids[t].tolist()) <= active
        assert (cw[t, len(kept):] == 0).all()
    assert compact_slots(ids, w, torch.zeros_like(keep)) is None
