"""Packed state round trip, the NUMA split, and what each format costs in accuracy."""

import numpy as np
import pytest
import torch

from hybridmoe import CpuExperts
from hybridmoe.experts.torch_ref import ref_moe

E, H, I = 4, 128, 96


@pytest.mark.parametrize("fmt,zero_points", [("bf16", False), ("int8", False), ("int4", False), ("int4", True)])
def test_from_packed_uses_the_buffers_and_matches(make_weights, make_routing, fmt, zero_points):
    experts = CpuExperts(*make_weights(E, H, I), format=fmt, group_size=32, zero_points=zero_points, threads=2)
    state = experts.packed_state()
    copied = {**state, "buffers": {k: np.array(v) for k, v in state["buffers"].items()}}
    restored = CpuExperts.from_packed(copied, threads=2)
    x, ids, weights = make_routing(6, H, 2, range(E))
    assert torch.equal(restored.forward(x, ids, weights), experts.forward(x, ids, weights))


def test_packed_size_is_the_format_size(make_weights):
    n = E * 3 * H * I  # H and I are multiples of 32: no padding
    sizes = {fmt: CpuExperts(*make_weights(E, H, I), format=fmt, group_size=32, threads=1).packed_bytes
             for fmt in ("bf16", "int8", "int4")}
    assert sizes == {"bf16": 2 * n, "int8": n + 4 * E * (2 * I + H), "int4": n // 2 + 4 * n // 32}


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_numa_split_gives_identical_results(make_weights, make_routing, fmt):
    # Two worker groups, each owning half of every expert's output rows (one buffer per slice).
    w = make_weights(E, H, I)
    one = CpuExperts(*w, format=fmt, group_size=32, threads=2)
    two = CpuExperts(*w, format=fmt, group_size=32, threads=2, numa_nodes=2)
    assert {k.split(".")[1] for k in two.packed_state()["buffers"]} == {"0", "1"}
    x, ids, weights = make_routing(20, H, 2, range(E))
    assert torch.equal(one.forward(x, ids, weights), two.forward(x, ids, weights))
    assert all(torch.equal(a, b) for e in range(E) for a, b in zip(one.dequantized(e), two.dequantized(e)))


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("zero_points", [False, True])
def test_int4_format_error_per_group_size(make_weights, make_routing, tolerance, rel_err, group_size,
                                          zero_points):
    H4, I4 = 256, 128
    w = make_weights(E, H4, I4)
    experts = CpuExperts(*w, format="int4", group_size=group_size, zero_points=zero_points, threads=2)
    x, ids, weights = make_routing(32, H4, 2, range(E))
    err = rel_err(experts.forward(x, ids, weights), ref_moe(x, *w, ids, weights))
    # Round-to-nearest on Gaussian weights: ~0.15 at g32 up to ~0.21 at g128.
    assert 0.05 < err < tolerance["int4"]["vs_fp32"][group_size]
