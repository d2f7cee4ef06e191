"""Packed experts dequantized with torch (experts/packed_torch.py) equal the native engine's own
unpacking (CpuExperts.dequantized) bit for bit, in every format, group size, zero-point mode and
NUMA slicing, with shapes that are not multiples of the 32-row blocks."""

import pytest
import torch

from hybridmoe.experts.packed_torch import PackedLayout

cpu_experts = pytest.importorskip("hybridmoe.experts.cpu_experts")

# E experts, H hidden, I intermediate; int4 needs H and I divisible by the group size.
CASES = [
    ("bf16", 128, False, 1, (3, 48, 40)),
    ("bf16", 128, False, 2, (2, 96, 72)),
    ("int8", 128, False, 1, (3, 48, 40)),
    ("int8", 128, False, 2, (2, 96, 72)),
    ("int4", 32, False, 1, (3, 64, 96)),
    ("int4", 32, True, 2, (2, 96, 64)),
    ("int4", 64, True, 1, (2, 128, 64)),
    ("int4", 128, False, 1, (2, 128, 256)),
]


def torch_buffers(state: dict) -> dict[str, torch.Tensor]:
    """packed_state()'s numpy views as flat uint8 tensors (what a staging buffer on a device holds)."""
    return {name: torch.from_numpy(arr).view(torch.uint8) for name, arr in state["buffers"].items()}


@pytest.mark.parametrize("fmt, group, zero_points, numa, shape", CASES)
def test_dequantized_equals_the_engines_unpacking(fmt, group, zero_points, numa, shape):
    E, H, I = shape
    g = torch.Generator().manual_seed(E * H + I)
    gate, up = torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g)
    down = torch.randn(E, H, I, generator=g)
    experts = cpu_experts.CpuExperts(gate, up, down, format=fmt, group_size=group, zero_points=zero_points,
                                     threads=2, numa_nodes=numa)
    state = experts.packed_state()
    layout = PackedLayout(state)
    assert layout.buffer_bytes() == {name: arr.nbytes for name, arr in state["buffers"].items()}
    ids = torch.tensor([E - 1, 0])
    got = layout.dequantize(torch_buffers(state), ids, torch.float32)
    for i, e in enumerate(ids.tolist()):
        for mine, theirs in zip(got, experts.dequantized(e)):
            assert torch.equal(mine[i], theirs)


@pytest.mark.parametrize("fmt, zero_points", [("bf16", False), ("int8", False), ("int4", False), ("int4", True)])
def test_dequantized_to_bf16_is_the_rounded_float32(fmt, zero_points):
    E, H, I = 2, 64, 96
    experts = cpu_experts.CpuExperts(torch.randn(E, I, H), torch.randn(E, I, H), torch.randn(E, H, I),
                                     format=fmt, group_size=32, zero_points=zero_points, threads=1)
    state = experts.packed_state()
    got = PackedLayout(state).dequantize(torch_buffers(state), torch.tensor([1]), torch.bfloat16)
    for mine, theirs in zip(got, experts.dequantized(1)):
        assert mine.dtype == torch.bfloat16 and torch.equal(mine[0], theirs.to(torch.bfloat16))
