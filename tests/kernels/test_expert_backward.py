"""CpuExperts.backward against float32 torch autograd of the same experts, every format x every kernel path.

The reference is autograd of sum_k w[t, k] * (down_e glu(gate_e x + b_gate, up_e x + b_up) + b_down) in float32 on
the weights the engine holds: the original float weights rounded to bf16 for bf16 layers, CpuExperts.dequantized for
the others (the engine's own dequantization: what is under test is the backward). x and grad_out are bf16 (what a
bf16 model hands the layer), so both sides read them exactly.

Bounds, from bf16's unit roundoff u = 2^-8 (7 stored mantissa bits: a rounding moves a value by at most u of it):
- grad_x, relative L2 error: each rounding to bf16 on its path adds an error of rms below u / sqrt(3) of the values
  it rounds, independent roundings add in quadrature, so n roundings stay below u sqrt(n). On every path grad_x is
  stored in bf16 (1); on the AVX-512 paths (and the AMX ones, which run them) dg and du are read in bf16 (+1), and
  the int8, int4 and fp8 weights are rounded to bf16 in both transposed products (+2; bf16 and mxfp4 weights are
  bf16 values).
- grad_topk_weights, per element: dw = <Wd^T grad_out, h> + <grad_out, b_down>; rounding the weights in
  Wd^T grad_out to bf16 (quantized formats on the AVX-512 paths) moves it by at most u |grad_out| |Wd| |h|, the
  bias's part is float32 on every path: u times that sum of magnitudes bounds every path. (Relative to dw itself
  there is no such bound: a dw near zero is the sum of terms that cancel.)
"""

import math

import pytest
import torch
import torch.nn.functional as F

from hybridmoe import CpuExperts
from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.cpu_experts import available_isas
from hybridmoe.layers.clamped_swiglu import ClampedSwiGLU

ISAS = available_isas()
PATHS = ISAS + (["amx_emulated"] if "avx512" in ISAS else [])
"""The AMX layers' backward runs the AVX-512 kernels: amx_emulated (an AMX layer where AVX-512 is) checks that they do."""
BF16_PATHS = {"avx512", "amx", "amx_emulated"}  # dot products of bf16 pairs
FORMATS = ["bf16", "int8", "int4", "fp8", "mxfp4"]
QUANTIZED = {"int8", "int4", "fp8"}  # weights that are not bf16 values
E, H, I = 10, 160, 96  # 5 and 3 blocks of 32 rows; int4 groups of 32
ROUTED = [0, 1, 2, 4, 5, 7, 8, 9]  # experts 3 and 6 get no tokens
BF16_UNIT = 2.0**-8
GLU = ClampedSwiGLU(alpha=1.702, limit=7.0)


def grad_x_bound(fmt: str, path: str) -> float:
    roundings = 1 + (path in BF16_PATHS) * (1 + 2 * (fmt in QUANTIZED))
    return BF16_UNIT * math.sqrt(roundings)


def draw_weights(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, I, H, generator=g) / H**0.5, torch.randn(E, I, H, generator=g) / H**0.5,
            torch.randn(E, H, I, generator=g) / I**0.5)


def draw_biases(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return 2 * torch.randn(E, I, generator=g), 2 * torch.randn(E, I, generator=g), 6 * torch.randn(E, H, generator=g)


def draw_call(T: int, K: int, seed: int, x_scale: float = 1.0):
    """bf16 x and grad_out [T, H], ids [T, K] distinct per token from ROUTED, weights [T, K]."""
    g = torch.Generator().manual_seed(seed)
    x = (x_scale * torch.randn(T, H, generator=g)).bfloat16()
    ids = torch.stack([torch.tensor(ROUTED)[torch.randperm(len(ROUTED), generator=g)[:K]] for _ in range(T)])
    return x, ids.reshape(T, K), torch.rand(T, K, generator=g), torch.randn(T, H, generator=g).bfloat16()


def reference(x, weights, ids, topk_weights, grad_out, glu=None, biases=None):
    """Autograd in float32: (grad_x, grad_topk_weights, the sums |grad_out| |Wd| |h| per (token, slot))."""
    gate, up, down = weights
    gb, ub, db = biases if biases is not None else (torch.zeros(E, I), torch.zeros(E, I), torch.zeros(E, H))
    x = x.float().requires_grad_()
    w = topk_weights.float().clone().requires_grad_()
    dout = grad_out.float()
    out, sums = torch.zeros(x.shape), torch.zeros(w.shape)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        g, u = x[tok] @ gate[e].T + gb[e], x[tok] @ up[e].T + ub[e]
        h = glu(g, u) if glu is not None else F.silu(g) * u
        out = out.index_add(0, tok, (h @ down[e].T + db[e]) * w[tok, slot].unsqueeze(1))
        sums[tok, slot] = ((dout[tok].abs() @ down[e].abs()) * h.detach().abs()).sum(1)
    (out * dout).sum().backward()
    return x.grad, w.grad, sums


def held_weights(layer: CpuExperts, fmt: str, weights):
    """The weights the engine holds: the originals rounded to bf16 for bf16, else the engine's dequantization."""
    if fmt == "bf16":
        return tuple(w.bfloat16().float() for w in weights)
    return tuple(torch.stack(p) for p in zip(*(layer.dequantized(e) for e in range(E))))


@pytest.fixture(scope="module")
def layer():
    """One packed layer per (format, path, activation), with its held weights; packed once for the module."""
    cache = {}

    def get(fmt: str, path: str, glu=None, biases=False, numa_nodes=1):
        key = (fmt, path, glu, biases, numa_nodes)
        if key not in cache:
            ex = CpuExperts(*draw_weights(), format=fmt, group_size=32, threads=2, isa=path, numa_nodes=numa_nodes)
            if glu is not None:
                ex.set_glu(glu)
            if biases:
                ex.set_biases(*draw_biases())
            cache[key] = ex, held_weights(ex, fmt, draw_weights())
        return cache[key]
    return get


def check(ex, held, fmt, path, call, glu=None, biases=None):
    x, ids, w, dout = call
    grad_x, grad_w = ex.backward(x, ids, w, dout)
    assert grad_x.shape == x.shape and grad_x.dtype == x.dtype
    assert grad_w.shape == w.shape and grad_w.dtype == torch.float32
    ref_x, ref_w, sums = reference(x, held, ids, w, dout, glu, biases)
    err_x = ((grad_x.float() - ref_x).norm() / ref_x.norm()).item()
    assert err_x < grad_x_bound(fmt, path), f"grad_x off by {err_x:.2e}"
    ratio = ((grad_w - ref_w).abs() / sums).max().item()
    assert ratio < BF16_UNIT, f"grad_topk_weights off by {ratio:.2e} of its terms' magnitudes"
    return grad_x, grad_w


@pytest.mark.parametrize("T, K", [(1, 2), (7, 8), (64, 2), (64, 8)])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("path", ISAS)
def test_gradients_match_fp32_autograd(layer, path, fmt, T, K):
    ex, held = layer(fmt, path)
    check(ex, held, fmt, path, draw_call(T, K, seed=10 * T + K))


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
@pytest.mark.parametrize("path", PATHS)
def test_clamped_swiglu_and_biases(layer, path, fmt):
    """gpt-oss's experts: x large enough that the gate passes the limit and up passes it on both sides. (Formats whose
    forward reads x in bf16, as given: their gate and up sums are the reference's to float32 rounding, so no value
    lands on the other side of a clamp than in the reference.)"""
    ex, held = layer(fmt, path, GLU, biases=True)
    call = draw_call(33, 4, seed=5, x_scale=8.0)
    x, ids = call[0].float(), call[1]
    gate_x = torch.einsum("eih,th->tei", held[0], x)[torch.arange(33)[:, None], ids] + draw_biases()[0][ids]
    up_x = torch.einsum("eih,th->tei", held[1], x)[torch.arange(33)[:, None], ids] + draw_biases()[1][ids]
    assert (gate_x > GLU.limit).any() and (up_x > GLU.limit).any() and (up_x < -GLU.limit).any()
    check(ex, held, fmt, path, call, GLU, draw_biases())


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("path", PATHS)
def test_silu_with_biases(layer, path, fmt):
    ex, held = layer(fmt, path, biases=True)
    check(ex, held, fmt, path, draw_call(20, 3, seed=6), None, draw_biases())


def test_the_clamps_and_every_bias_move_the_gradients_far_past_the_bounds():
    """Dropping a clamp or any one bias moves the reference gradients by far more than any bound above: a backward
    that drops one fails the tests above."""
    weights = tuple(w.bfloat16().float() for w in draw_weights())
    x, ids, w, dout = draw_call(33, 4, seed=5, x_scale=8.0)
    ref_x, ref_w, _ = reference(x, weights, ids, w, dout, GLU, draw_biases())
    variants = {"no clamps": reference(x, weights, ids, w, dout, ClampedSwiGLU(GLU.alpha, math.inf), draw_biases())}
    for i, name in enumerate(("gate", "up", "down")):
        dropped = tuple(torch.zeros_like(b) if j == i else b for j, b in enumerate(draw_biases()))
        variants[f"no {name} bias"] = reference(x, weights, ids, w, dout, GLU, dropped)
    for name, (other_x, other_w, _) in variants.items():
        moved = max(((other_x - ref_x).norm() / ref_x.norm()).item(), ((other_w - ref_w).norm() / ref_w.norm()).item())
        assert moved > 0.1, name


@pytest.mark.parametrize("path", PATHS)
def test_a_repeated_expert_of_weight_zero_gets_its_gradient(layer, path):
    """A slot of weight 0 may repeat an expert (padding): its weight's gradient is <grad_out, y> all the same."""
    ex, held = layer("bf16", path)
    x, ids, w, dout = draw_call(7, 3, seed=8)
    ids[:, 2], w[:, 2] = ids[:, 0], 0.0
    _, grad_w = check(ex, held, "bf16", path, (x, ids, w, dout))
    torch.testing.assert_close(grad_w[:, 2], grad_w[:, 0], rtol=1e-6, atol=0)


@pytest.mark.parametrize("path", PATHS)
def test_passes_and_slices_give_the_same_gradients(layer, path):
    """chunk_tokens=5 runs 64 tokens in 13 passes, numa_nodes=2 cuts each matrix's rows in two slices: the same
    gradients as one pass over whole matrices, to float32 summation order."""
    call = draw_call(64, 8, seed=9)
    one_pass = layer("int4", path)[0].backward(*call)
    for grads in (layer("int4", path)[0].backward(*call, chunk_tokens=5),
                  layer("int4", path, numa_nodes=2)[0].backward(*call)):
        for got, want in zip(grads, one_pass):
            assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-6


@pytest.mark.parametrize("path", PATHS)
def test_float32_inputs_give_float32_gradients(layer, path):
    """x and grad_out in float32: grad_x in float32, not rounded; the bf16 layer reads x rounded to bf16, and the
    AVX-512 paths grad_out too (and dg, du as above)."""
    ex, held = layer("bf16", path)
    x, ids, w, dout = draw_call(16, 2, seed=4)
    x, dout = x.float() + 1e-3 * torch.randn(x.shape), dout.float() + 1e-3 * torch.randn(dout.shape)
    grad_x, grad_w = ex.backward(x, ids.int(), w, dout)
    assert grad_x.dtype == torch.float32
    ref_x, ref_w, _ = reference(x, held, ids, w, dout)
    bound = BF16_UNIT * math.sqrt(1 + 2 * (path in BF16_PATHS))
    assert ((grad_x - ref_x).norm() / ref_x.norm()).item() < bound
    assert ((grad_w - ref_w).norm() / ref_w.norm()).item() < bound


def test_no_tokens_gives_empty_gradients(layer):
    ex, _ = layer("bf16", PATHS[-1])
    grad_x, grad_w = ex.backward(torch.zeros(0, H, dtype=torch.bfloat16), torch.zeros(0, 2, dtype=torch.int64),
                                 torch.zeros(0, 2), torch.zeros(0, H, dtype=torch.bfloat16))
    assert grad_x.shape == (0, H) and grad_w.shape == (0, 2)


@pytest.mark.parametrize("change, says", [
    (lambda c: {**c, "grad_out": c["grad_out"][:, :-1]}, r"grad_out has shape \[4, 159\], expected \[4, 160\]"),
    (lambda c: {**c, "grad_out": c["grad_out"].to(torch.float16)}, "grad_out must be bfloat16 or float32, got float16"),
    (lambda c: {**c, "grad_out": c["grad_out"].t().contiguous().t()}, "grad_out must be contiguous"),
    (lambda c: {**c, "grad_out": "dout"}, "grad_out must be a torch.Tensor, got str"),
    (lambda c: {**c, "topk_ids": torch.tensor([[1, 1]] * 4)}, "token 0 lists expert 1 twice"),
    (lambda c: {**c, "topk_weights": c["topk_weights"].double()}, "topk_weights must be float32, got float64"),
    (lambda c: {**c, "chunk_tokens": 0}, "chunk_tokens must be between 1 and"),
], ids=["grad-out-shape", "grad-out-dtype", "grad-out-strides", "grad-out-type", "duplicate", "weights-dtype",
        "chunk-tokens"])
def test_bad_arguments_fail_in_one_line(layer, change, says):
    ex, _ = layer("bf16", PATHS[0])
    x, ids, w, dout = draw_call(4, 2, seed=1)
    args = change({"x": x, "topk_ids": ids, "topk_weights": w, "grad_out": dout})
    with pytest.raises(HybridMoEError, match=says) as e:
        ex.backward(**args)
    assert "\n" not in str(e.value)


def test_backward_waits_for_a_submitted_call(layer):
    ex, _ = layer("bf16", PATHS[0])
    x, ids, w, dout = draw_call(2, 2, seed=2)
    ex.submit(x, ids, w)
    with pytest.raises(HybridMoEError, match=r"backward\(\) called between submit\(\) and wait\(\)"):
        ex.backward(x, ids, w, dout)
    ex.wait()
