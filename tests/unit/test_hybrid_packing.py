"""HybridExperts.set_layer_experts (the loader's path: one expert at a time from the checkpoint) builds the same
layer as set_layer on stacked tensors: GPU experts in the plan's order, the CPU engine's experts packed the same."""

import numpy as np
import pytest
import torch

from hybridmoe.experts.cpu_experts import CpuExperts
from hybridmoe.experts.factory import (
    _NativeLayer,  # the CPU engine factory the loader gives a native hybrid
)
from hybridmoe.experts.hybrid import HybridExperts, TorchCpuLayer
from hybridmoe.experts.placement import Footprint, PlacementPlan

E, H, I, K, T = 8, 64, 32, 3, 5  # experts, hidden, intermediate, experts per token, tokens


def backend(gpu_ids, kind):
    fp = Footprint(0, 0, 0, 3 * I * H * 4, [0], E, K, H, I)
    plan = PlacementPlan(fp, None, "test", {0: gpu_ids} if gpu_ids else {})
    cpu_layer = _NativeLayer(CpuExperts, format="bf16", threads=1) if kind == "native" else TorchCpuLayer
    return HybridExperts(plan, "cpu", cpu_layer)


@pytest.mark.parametrize("gpu_ids", [[], [6], [5, 0, 3], list(range(E))])
@pytest.mark.parametrize("kind", ["torch", "native"])
def test_one_expert_at_a_time_builds_the_stacked_layer(gpu_ids, kind):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(E, I, H, generator=g) / 8, torch.randn(E, I, H, generator=g) / 8,
         torch.randn(E, H, I, generator=g) / 6)
    stacked, one_by_one = backend(gpu_ids, kind), backend(gpu_ids, kind)
    stacked.set_layer(0, *w)
    one_by_one.set_layer_experts(0, ((w[0][e], w[1][e], w[2][e]) for e in range(E)), E)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=g)
    assert torch.equal(one_by_one.forward(0, x, ids, weights), stacked.forward(0, x, ids, weights))
    a, b = stacked.cpu_engine(0), one_by_one.cpu_engine(0)
    assert (a is None) == (b is None) == (len(gpu_ids) == E)
    if kind == "native" and a is not None:
        for name, buf in a.packed_state()["buffers"].items():
            assert np.array_equal(np.asarray(buf), np.asarray(b.packed_state()["buffers"][name])), name
