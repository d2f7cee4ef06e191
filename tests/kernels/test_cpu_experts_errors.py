"""Bad input raises HybridMoEError with a message that says what is wrong; never a crash."""

import pytest
import torch

from hybridmoe import CpuExperts
from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.cpu_experts import available_isas

E, H, I, T, K = 4, 64, 32, 3, 2


@pytest.fixture(scope="module")
def experts():
    g = torch.Generator().manual_seed(0)
    return CpuExperts(torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g),
                      torch.randn(E, H, I, generator=g), threads=2)


def inputs():
    return torch.randn(T, H), torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.rand(T, K)


@pytest.mark.parametrize("change,message", [
    (lambda x, i, w: (x.double(), i, w), "x must be bfloat16 or float32"),
    (lambda x, i, w: (x[:, :H - 1], i, w), "x has shape"),
    (lambda x, i, w: (x.t().contiguous().t(), i, w), "x must be contiguous"),
    (lambda x, i, w: (x[None], i, w), "x must have 2 dimensions"),
    (lambda x, i, w: (x, i.float(), w), "topk_ids must be int32 or int64"),
    (lambda x, i, w: (x, i[:2], w), "topk_ids has shape"),
    (lambda x, i, w: (x, i, w.double()), "topk_weights must be float32"),
    (lambda x, i, w: (x, i, w[:, :1]), "topk_weights has shape"),
    (lambda x, i, w: (x, torch.tensor([[0, 1], [2, 4], [1, 2]]), w), "out of range for 4 experts"),
    (lambda x, i, w: (x, torch.tensor([[0, 1], [2, -1], [1, 2]]), w), "out of range"),
    (lambda x, i, w: (x, torch.tensor([[0, 1], [3, 3], [1, 2]]), w), "lists expert 3 twice"),
])
def test_bad_forward_input(experts, change, message):
    with pytest.raises(HybridMoEError, match=message):
        experts.forward(*change(*inputs()))


def test_tensor_on_another_device_is_refused(experts):
    x, ids, w = inputs()
    with pytest.raises(HybridMoEError):
        experts.forward(x.to("meta"), ids, w)


def test_engine_still_works_after_errors(experts):
    x, ids, w = inputs()
    with pytest.raises(HybridMoEError):
        experts.forward(x, ids + 10, w)
    assert torch.isfinite(experts.forward(x, ids, w)).all()


@pytest.mark.parametrize("kwargs,message", [
    ({"format": "fp4"}, "unknown expert format"),
    ({"format": "fp8", "zero_points": True}, "zero points exist only"),
    ({"format": "int4", "group_size": 48}, "group_size must be 32, 64 or 128"),
    ({"format": "int4", "group_size": 128}, "divisible by it"),
    ({"format": "int8", "zero_points": True}, "zero points exist only"),
    ({"isa": "neon"}, "unknown isa"),
    ({"threads": 0}, "threads must be"),
    ({"threads": 2, "numa_nodes": 3}, "numa_nodes must be"),
])
def test_bad_construction(kwargs, message):
    w = (torch.randn(E, I, H), torch.randn(E, I, H), torch.randn(E, H, I))
    with pytest.raises(HybridMoEError, match=message):
        CpuExperts(*w, **kwargs)


def test_isa_this_cpu_lacks_is_refused():
    missing = [isa for isa in ("avx2", "avx512", "amx") if isa not in available_isas()]
    if not missing:
        pytest.skip("this CPU has every ISA path")
    with pytest.raises(HybridMoEError, match="not supported by this CPU"):
        CpuExperts(torch.randn(E, I, H), torch.randn(E, I, H), torch.randn(E, H, I), isa=missing[0])


def test_mismatched_weight_shapes():
    with pytest.raises(HybridMoEError, match="down_proj must be"):
        CpuExperts(torch.randn(E, I, H), torch.randn(E, I, H), torch.randn(E, I, H))


def test_submit_twice_and_wait_without_submit(experts):
    with pytest.raises(HybridMoEError, match="without a submit"):
        experts.wait()
    experts.submit(*inputs())
    with pytest.raises(HybridMoEError, match="called twice"):
        experts.submit(*inputs())
    with pytest.raises(HybridMoEError, match="between submit"):
        experts.forward(*inputs())
    experts.wait()


def test_packed_state_with_missing_buffer_is_refused(experts):
    state = experts.packed_state()
    state["buffers"].pop("down.0.w")
    with pytest.raises(HybridMoEError, match="missing"):
        CpuExperts.from_packed(state, threads=2)


def test_packed_buffer_of_wrong_size_is_refused(experts):
    state = experts.packed_state()
    state["buffers"]["gate.0.w"] = state["buffers"]["gate.0.w"][:-1]
    with pytest.raises(HybridMoEError, match="expected"):
        CpuExperts.from_packed(state, threads=2)
