"""CpuExperts.from_experts: packing one expert at a time from an iterator (what the loader feeds it straight
from a mapped checkpoint) gives the constructor's packed bytes, and asks for each expert only after the last."""

import numpy as np
import pytest
import torch

from hybridmoe import CpuExperts
from hybridmoe.errors import HybridMoEError

E, H, I = 5, 96, 64


def _per_expert(w):
    gate, up, down = w
    return [(gate[e], up[e], down[e]) for e in range(gate.shape[0])]


@pytest.mark.parametrize("fmt,zero_points", [("bf16", False), ("int8", False), ("int4", False), ("int4", True)])
def test_from_experts_packs_the_constructors_bytes(make_weights, fmt, zero_points):
    w = [t.to(torch.bfloat16) for t in make_weights(E, H, I)]
    options = dict(format=fmt, group_size=32, zero_points=zero_points, threads=2)
    stacked = CpuExperts(*w, **options).packed_state()
    one_by_one = CpuExperts.from_experts(iter(_per_expert(w)), E, **options).packed_state()
    assert stacked.keys() == one_by_one.keys()
    assert stacked["buffers"].keys() == one_by_one["buffers"].keys()
    for name, buf in stacked["buffers"].items():
        assert np.array_equal(np.asarray(buf), np.asarray(one_by_one["buffers"][name])), name


def test_each_expert_is_asked_for_after_the_last_is_packed(make_weights):
    w = _per_expert(make_weights(E, H, I))
    events = []

    def source():
        for e in range(E):
            events.append(("read", e))
            yield w[e]
            events.append(("done", e))  # where the loader releases expert e's checkpoint pages

    CpuExperts.from_experts(source(), E, threads=2)
    assert events == [(kind, e) for e in range(E) for kind in ("read", "done")]


def test_from_experts_rejects_a_wrong_count_or_dtype(make_weights):
    w = _per_expert(make_weights(E, H, I))
    with pytest.raises(HybridMoEError, match="got 4 experts, expected num_experts=5"):
        CpuExperts.from_experts(iter(w[:4]), E, threads=1)
    with pytest.raises(HybridMoEError, match="more experts than num_experts=4"):
        CpuExperts.from_experts(iter(w), 4, threads=1)
    with pytest.raises(HybridMoEError, match="no experts"):
        CpuExperts.from_experts(iter([]), E, threads=1)
    ints = [tuple(t.to(torch.int32) for t in w[0])]
    with pytest.raises(HybridMoEError, match="expert 0's gate must be a float tensor"):
        CpuExperts.from_experts(iter(ints), 1, threads=1)
    with pytest.raises(HybridMoEError, match=rf"expert 0's down must be \[{H}, {I}\]"):
        CpuExperts.from_experts(iter([(w[0][0], w[0][1], w[0][1])]), 1, threads=1)
    with pytest.raises(HybridMoEError, match=rf"expert 1's up must be \[{I}, {H}\], got \[{I}, {H - 32}\]"):
        CpuExperts.from_experts(iter([w[0], (w[1][0], w[1][1][:, :-32], w[1][2])]), 2, threads=1)
