"""torch.ops.hybridmoe.cpu_experts: the layer as a registered custom op (fake kernel, opcheck)."""

import pytest
import torch

from hybridmoe import CpuExperts
from hybridmoe.errors import HybridMoEError

E, H, I, K = 4, 64, 32, 2


@pytest.fixture
def experts(make_weights):
    return CpuExperts(*make_weights(E, H, I), threads=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_equals_forward_and_passes_opcheck(experts, make_routing, dtype):
    x, ids, weights = make_routing(5, H, K, range(E))
    args = (x.to(dtype), ids, weights, experts.handle)
    out = torch.ops.hybridmoe.cpu_experts(*args)
    assert out.dtype == dtype and torch.equal(out, experts.forward(*args[:3]))
    torch.library.opcheck(torch.ops.hybridmoe.cpu_experts.default, args)


def test_fake_tensor_gives_shape_without_running(experts):
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x, ids, w = torch.empty(3, H), torch.zeros(3, K, dtype=torch.long), torch.empty(3, K)
        out = torch.ops.hybridmoe.cpu_experts(x, ids, w, experts.handle)
    assert out.shape == (3, H)


def test_unknown_handle_is_an_error(experts, make_routing):
    x, ids, weights = make_routing(2, H, K, range(E))
    with pytest.raises(HybridMoEError, match="no live CpuExperts"):
        torch.ops.hybridmoe.cpu_experts(x, ids, weights, experts.handle + 1000)
