"""The Triton GPU share (fixed_shape_experts on CUDA) equals weighted_experts, the reference, for
T = 1, 4, 8 (decode: expert-major), 9 and 300 (sorted blocks of 16 and 64 slots; 300 through
gpu_share, as prefill runs it), with masks and repeated ids, eagerly and as a CUDA graph replay;
and it reads no weights of experts no kept slot routes to (they hold NaN here). gpt-oss's experts (per-expert
biases, the clamped SwiGLU with its clamps binding) through each kernel form (expert-major, sorted blocks, the
slot-major GEMV with K split or not) against the float32 reference.
Runs on the GPU host through scripts/device_check.sh; the gpt-oss cases in float32 also on the CPU under Triton's
interpreter (TRITON_INTERPRET=1, triton installed), calling the kernels (triton_experts) directly.

T tokens, K slots per token, E experts on the GPU, H hidden, I intermediate (neither a multiple
of the kernels' blocks).
"""

import pytest
import torch
import torch.nn.functional as F
from kernels_device import kernels_device

from hybridmoe.experts.gpu_experts import (
    fixed_shape_experts,
    gpu_share,
    triton_usable,
    weighted_experts,
)
from hybridmoe.layers.clamped_swiglu import ClampedSwiGLU

DEVICE = kernels_device()

pytestmark = pytest.mark.device
cuda_only = pytest.mark.skipif(DEVICE != "cuda", reason="gpu_share's dispatch, CUDA graphs, long steps and bfloat16 "
                               "dots (the interpreter multiplies bfloat16 bits): on the GPU only")

E, H, I, K = 12, 200, 72, 8
FP32 = {"atol": 1e-4, "rtol": 1e-4}
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
    return [t.to(DEVICE) for t in (x.to(dtype), gate.to(dtype), up.to(dtype), down.to(dtype), wild, weights, mask)]


def assert_near(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **FP32)
    else:
        assert (got - want).abs().max().item() <= BF16_MAX_ERROR * want.abs().max().item()


@cuda_only
def test_triton_runs_on_cuda():
    assert triton_usable(torch.device("cuda"), F.silu)
    assert triton_usable(torch.device("cuda"), ClampedSwiGLU(alpha=1.702, limit=7.0))
    assert not triton_usable(torch.device("cuda"), F.gelu)  # the kernels compute SiLU or the clamped SwiGLU


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 4, 8, 9, 300])
def test_triton_experts_equal_weighted_experts(T, dtype):
    x, gate, up, down, ids, weights, mask = inputs(T, dtype, unused=3)
    got = gpu_share(x, gate, up, down, ids, weights, mask, F.silu)
    want = weighted_experts(x, gate, up, down, ids, weights, mask, F.silu)
    assert got.dtype == torch.float32 and got.shape == (T, H)
    assert T == 1 or bool(got[-1].eq(0).all())
    assert_near(got, want, dtype)


@cuda_only
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


GLU = ClampedSwiGLU(alpha=1.702, limit=1.5)
"""A limit the gate and up sums pass (both ways for up) at inputs() scale, so the clamps bind."""


def gpt_oss_biases(dtype: torch.dtype, unused: int = 3):
    """(gate [E, I], up [E, I], down [E, H]) standard normal, in dtype on DEVICE; the last `unused` experts' NaN."""
    g = torch.Generator().manual_seed(11)
    biases = (torch.randn(E, I, generator=g), torch.randn(E, I, generator=g), torch.randn(E, H, generator=g))
    for b in biases:
        b[E - unused:] = float("nan")
    return tuple(b.to(DEVICE, dtype) for b in biases)


FORMS = [(1, False, None), (9, False, None), (1, True, (1, 1)), (1, True, (2, 3)),
         pytest.param(4, False, None, marks=cuda_only), pytest.param(300, False, None, marks=cuda_only),
         pytest.param(4, True, (2, 1), marks=cuda_only)]
"""(T, gemv, split_k): expert-major (1, 4), sorted blocks (9, 300), the GEMV kernels whole and with gate/up and down
split (each split's bias added once)."""


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=cuda_only)])
@pytest.mark.parametrize("act,with_biases", [(GLU, True), (F.silu, True), (GLU, False)], ids=["glu-biases",
                                                                                          "silu-biases", "glu"])
@pytest.mark.parametrize("T,gemv,split_k", FORMS)
def test_biases_and_the_clamped_swiglu_equal_the_float32_reference(T, gemv, split_k, act, with_biases, dtype):
    """triton_experts with gpt-oss's experts against weighted_experts in float32 over the same weights and biases;
    the biases of experts no kept slot routes to (NaN) are never read."""
    from hybridmoe.experts.gpu_experts_triton import triton_experts

    x, gate, up, down, ids, weights, mask = inputs(T, dtype, unused=3)
    biases = gpt_oss_biases(dtype) if with_biases else None
    if isinstance(act, ClampedSwiGLU) and T == 9:  # the clamps bind: gate past the limit, up past it both ways
        gate_x = torch.einsum("th,eih->tei", x.float(), torch.nan_to_num(gate.float()))
        up_x = torch.einsum("th,eih->tei", x.float(), torch.nan_to_num(up.float()))
        assert (gate_x > act.limit).any() and (up_x > act.limit).any() and (up_x < -act.limit).any()
    got = triton_experts(x, gate, up, down, ids, weights, mask, act, biases, gemv=gemv, split_k=split_k)
    f32 = tuple(b.float() for b in biases) if biases is not None else None
    want = weighted_experts(x.float(), gate.float(), up.float(), down.float(), ids, weights, mask, act, f32)
    assert got.dtype == torch.float32 and got.shape == (T, H) and not got.isnan().any()
    assert T == 1 or bool(got[-1].eq(0).all())
    assert_near(got, want, dtype)
    if with_biases:  # the biases move the result past the tolerance
        plain = weighted_experts(x.float(), gate.float(), up.float(), down.float(), ids, weights, mask, act)
        assert (plain - want).abs().max() > 50 * FP32["atol"] * want.abs().max()


@cuda_only
@pytest.mark.parametrize("T", [1, 8, 300])
def test_gpt_oss_experts_through_gpu_share_and_a_graph_replay(T):
    """gpu_share dispatches gpt-oss's experts to the kernels on CUDA, eagerly and replayed in a CUDA graph."""
    x, gate, up, down, ids, weights, mask = inputs(T, torch.bfloat16, unused=3)
    biases = gpt_oss_biases(torch.bfloat16)
    f32 = tuple(b.float() for b in biases)
    want = weighted_experts(x.float(), gate.float(), up.float(), down.float(), ids, weights, mask, GLU, f32)
    assert_near(gpu_share(x, gate, up, down, ids, weights, mask, GLU, biases), want, torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fixed_shape_experts(x, gate, up, down, ids, weights, mask, GLU, biases)
    graph.replay()
    assert_near(replayed, want, torch.bfloat16)
