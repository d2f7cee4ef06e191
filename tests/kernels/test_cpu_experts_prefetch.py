"""CpuExperts.prefetch: reads the listed experts' packed bytes (every buffer of each, once per listing),
refuses ids out of range, and never changes a result."""

import pytest
import torch

from hybridmoe import CpuExperts
from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.tuning import EngineTuning

E, H, I = 8, 128, 64


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("touch", [0, 1, 2, 3])
def test_prefetch_reads_each_listed_expert_and_changes_no_result(make_weights, make_routing, fmt, touch, isa):
    experts = CpuExperts(*make_weights(E, H, I), format=fmt, group_size=32, threads=2, isa=isa)
    x, ids, weights = make_routing(3, H, 2, range(E), seed=1)
    before = experts.forward(x, ids, weights)
    experts.tune(EngineTuning(prefetch_touch=touch))
    per_expert = experts.packed_bytes // E
    assert experts.prefetch([1, 5, 5]) == 3 * per_expert
    assert experts.prefetch(torch.tensor([], dtype=torch.int64)) == 0
    assert torch.equal(experts.forward(x, ids, weights), before)


def test_prefetch_refuses_bad_ids_and_touch_modes(make_weights):
    experts = CpuExperts(*make_weights(E, H, I), format="int4", group_size=32, threads=2)
    with pytest.raises(HybridMoEError, match="out of range for 8 experts"):
        experts.prefetch([0, E])
    with pytest.raises(HybridMoEError, match="out of range"):
        experts.prefetch([-1])
    with pytest.raises(HybridMoEError, match="prefetch_touch must be"):
        experts.tune(EngineTuning(prefetch_touch=4))
