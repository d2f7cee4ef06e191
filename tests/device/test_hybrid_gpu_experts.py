"""The Triton GPU share (fixed_shape_experts on CUDA) equals weighted_experts, the reference, for
T = 1, 4, 8 (decode: expert-major), 9 and 300 (sorted blocks of 16 and 64 slots; 300 through
gpu_share, as prefill runs it), with masks and repeated ids, eagerly and as a CUDA graph replay;
and it reads no weights of experts no kept slot routes to (they hold NaN here).
Runs on the GPU host through scripts/device_check.sh.

T tokens, K slots per token, E experts on the GPU, H hidden, I intermediate (neither a multiple
of the kernels' blocks).
"""

import pytest
import torch
import torch.nn.functional as F

from hybridmoe.experts.gpu_experts import (
    fixed_shape_experts,
    gpu_share,
    triton_usable,
    weighted_experts,
)

pytestmark = [pytest.mark.device,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

E, H, I, K = 12, 200, 72, 8
FP32 = dict(atol=1e-4, rtol=1e-4)
BF16_MAX_ERROR = 2e-2
"""bf16: the largest difference over the largest output (both sides round h to bf16, each its own way)."""


def inputs(T: int, dtype: torch.dtype, unused: int = 0):
    """Weights on the GPU with the last `unused` experts poisoned with NaN and never routed to."""
    g = torch.Generator().manual_seed(T)
    gate, up = torch.randn(E, I, H, generator=g) / 8, torch.randn(E, I, H, generator=g) / 8
    down = torch.randn(E, H, I, generator=g) / 6
    for w in (gate, up, down):
        w[E - unused:] = float("nan")
    x = torch.randn(T, H, generator=g)
    ids = torch.randint(0, E - unused, (T, K), generator=g)  # repeats within a token and across
    ids[:, 1] = ids[:, 0]
    weights = torch.rand(T, K, generator=g)
    mask = torch.rand(T, K, generator=g) < 0.6
    mask[:, 0] = True  # every token has a GPU slot ...
    if T > 1:
        mask[-1] = False  # ... but the last, which has none
    wild = torch.where(mask, ids, E - 1)  # masked slots name a poisoned expert: must not be read
    return [t.cuda() for t in (x.to(dtype), gate.to(dtype), up.to(dtype), down.to(dtype), wild, weights, mask)]


def assert_near(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **FP32)
    else:
        assert (got - want).abs().max().item() <= BF16_MAX_ERROR * want.abs().max().item()


def test_triton_runs_on_cuda():
    assert triton_usable(torch.device("cuda"), F.silu)
    assert not triton_usable(torch.device("cuda"), F.gelu)  # the kernels hard-code SiLU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 4, 8, 9, 300])
def test_triton_experts_equal_weighted_experts(T, dtype):
    x, gate, up, down, ids, weights, mask = inputs(T, dtype, unused=3)
    got = gpu_share(x, gate, up, down, ids, weights, mask, F.silu)
    want = weighted_experts(x, gate, up, down, ids, weights, mask, F.silu)
    assert got.dtype == torch.float32 and got.shape == (T, H)
    assert T == 1 or bool(got[-1].eq(0).all())
    assert_near(got, want, dtype)


@pytest.mark.parametrize("T", [1, 8])
def test_triton_experts_replayed_in_a_cuda_graph_equal_eager(T):
    x, gate, up, down, ids, weights, mask = inputs(T, torch.bfloat16, unused=3)
    eager = fixed_shape_experts(x, gate, up, down, ids, weights, mask, F.silu)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fixed_shape_experts(x, gate, up, down, ids, weights, mask, F.silu)
    fresh = inputs(T + 100, torch.bfloat16, unused=3)  # new routing and tokens, same shapes
    for buf, new in zip((x, ids, weights, mask), (fresh[0], fresh[4], fresh[5], fresh[6])):
        buf.copy_(new[:T])
    graph.replay()
    want = weighted_experts(x, gate, up, down, ids, weights, mask, F.silu)
    assert_near(replayed, want, torch.bfloat16)
    assert not torch.equal(replayed, eager)
