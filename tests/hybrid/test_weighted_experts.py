"""weighted_experts (the GPU share of the synchronous path, and the reference of the fixed-shape
one) equals a slot-by-slot sum, with masks, repeated ids and tokens routed nowhere.

T tokens, K slots per token, E experts, H hidden, I intermediate.
"""

import pytest
import torch
import torch.nn.functional as F

from hybridmoe.experts.gpu_experts import weighted_experts

E, H, I, K = 5, 16, 12, 4


def slot_by_slot(x, gate, up, down, ids, weights, mask):
    """float32 [T, H]: each kept slot's expert applied to its token, one at a time."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            if mask is None or mask[t, k]:
                e = int(ids[t, k])
                y = (F.silu(gate[e] @ x[t]) * (up[e] @ x[t])) @ down[e].t()
                out[t] += weights[t, k] * y
    return out


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("T", [1, 3, 9])
def test_weighted_experts_equal_a_slot_by_slot_sum(T, masked):
    g = torch.Generator().manual_seed(T)
    gate, up = torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g)
    down = torch.randn(E, H, I, generator=g)
    x = torch.randn(T, H, generator=g)
    ids = torch.randint(0, E, (T, K), generator=g)  # repeats within a token too
    weights = torch.rand(T, K, generator=g)
    mask = None
    if masked:
        mask = torch.rand(T, K, generator=g) < 0.5
        mask[0] = False  # a token routed to none of these experts
        ids = torch.where(mask, ids, E + 3)  # ids behind the mask are never read
    got = weighted_experts(x, gate, up, down, ids, weights, mask, F.silu)
    torch.testing.assert_close(got, slot_by_slot(x, gate, up, down, ids, weights, mask), atol=1e-4, rtol=1e-5)
