"""The fixed-shape GPU share (what a CUDA graph captures) equals weighted_experts' sum. On the CPU
this is its torch version, the one CI runs (the Triton kernels are tested in tests/device).

T tokens, K experts per token, E experts, H hidden, I intermediate. Both of its branches run:
3 * T * K < E gathers each slot's expert, otherwise every expert runs on every token.
"""

import pytest
import torch
import torch.nn.functional as F

from hybridmoe.experts.gpu_experts import fixed_shape_experts, weighted_experts

E, H, I, K = 16, 32, 24, 3
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _inputs(T: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    gate, up = (torch.randn(E, I, H, generator=g) * 0.2).to(dtype), (torch.randn(E, I, H, generator=g) * 0.2).to(dtype)
    down = (torch.randn(E, H, I, generator=g) * 0.2).to(dtype)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])  # [T, K] distinct per token
    weights = torch.rand(T, K, generator=g)
    mask = torch.rand(T, K, generator=g) < 0.6
    mask[0] = False  # a token with no slot here
    return x, gate, up, down, ids, weights, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 2, 5])  # 3 * 1 * 3 < 16 <= 3 * 2 * 3: gather vs every expert
def test_fixed_shape_experts_equal_weighted_experts(T, dtype):
    x, gate, up, down, ids, weights, mask = _inputs(T, dtype)
    got = fixed_shape_experts(x, gate, up, down, ids, weights, mask, F.silu)
    want = weighted_experts(x, gate, up, down, ids, weights, mask, F.silu)
    assert got.dtype == torch.float32 and got.shape == (T, H)
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


def test_fixed_shape_experts_ignore_masked_slots_even_if_their_ids_are_out_of_range():
    x, gate, up, down, ids, weights, mask = _inputs(4, torch.float32, seed=1)
    wild = torch.where(mask, ids, E + 7)  # ids a GPU share never holds, behind the mask
    got = fixed_shape_experts(x, gate, up, down, wild, weights, mask, F.silu)
    torch.testing.assert_close(got, weighted_experts(x, gate, up, down, ids, weights, mask, F.silu),
                               **TOLERANCE[torch.float32])
