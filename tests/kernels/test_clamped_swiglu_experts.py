"""gpt-oss's experts in the native engine: gate/up/down biases and the clamped SwiGLU, every format x every path.

An expert is y = down (glu(gate x + b_gate, up x + b_up)) + b_down, its routing weight times y summed per token;
glu the clamped SwiGLU (layers/clamped_swiglu.py: gate at most limit, up within [-limit, limit], (up + 1) * gate *
sigmoid(alpha * gate)). The weights are drawn on each format's grid (bf16 values; int8 integers times a row scale,
each row reaching 127; int4 integers in [-7, 7] times a group scale, each group reaching 7; fp8 e4m3 codes times a
128x128 block scale), so every format holds them exactly and the float32 reference multiplies them as drawn. Inputs
are large enough that gate and up pass the limit (up on both sides). Shapes are not tile multiples (I = 72: padding
columns of h beside the biases); T = 33 and 300 run the AMX kernels' tiles on the amx paths.
"""

import math

import pytest
import torch

from hybridmoe import CpuExperts
from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.cpu_experts import available_isas
from hybridmoe.experts.fp8_codes import FP8_BLOCK, Fp8Codes
from hybridmoe.layers.clamped_swiglu import ClampedSwiGLU

PATHS = available_isas() + (["amx_emulated"] if "avx512" in available_isas() else [])
FORMATS = ["bf16", "int8", "int4", "fp8"]
SHAPES = {"bf16": (6, 200, 72), "int8": (6, 200, 72), "int4": (6, 192, 96), "fp8": (6, 300, 136)}
TOKENS = [1, 4, 33, 300]
K = 3
GLU = ClampedSwiGLU(alpha=1.702, limit=7.0)
X_SCALE = 8.0
"""x ~ N(0, 8^2) and weights of norm ~1 per row: |gate x|, |up x| pass the limit 7 about a third of the time."""


def grid_matrix(fmt: str, n: int, k: int, g: torch.Generator):
    """A [n, k] matrix of rows ~ N(0, 1/k) on fmt's grid: a float32 tensor (Fp8Codes for fp8)."""
    if fmt == "bf16":
        return (torch.randn(n, k, generator=g) / k**0.5).bfloat16().float()
    if fmt == "fp8":
        codes = (torch.randn(n, k, generator=g) * 64).to(torch.float8_e4m3fn)
        scale = torch.rand(-(-n // FP8_BLOCK), -(-k // FP8_BLOCK), generator=g) / (64 * k**0.5) + 1e-4
        return Fp8Codes(codes, scale)
    top, span = (127, k) if fmt == "int8" else (7, 32)  # int4: groups of 32
    q = torch.randint(-top, top + 1, (n, k), generator=g).float()
    q[torch.arange(n).repeat_interleave(k // span), torch.arange(0, k, span).repeat(n)] = top  # each row/group's amax
    scale = (torch.rand(n, k // span, generator=g) + 0.5) / (top * (k / 3) ** 0.5)
    return q * scale.repeat_interleave(span, dim=1)


def as_float(w) -> torch.Tensor:
    """The float32 values of a grid matrix (fp8: each code decoded by torch, times its block's scale)."""
    if not isinstance(w, Fp8Codes):
        return w
    n, k = w.codes.shape
    return w.codes.float() * w.scale.repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]


def reference(x, weights, biases, glu, ids, topk_weights) -> torch.Tensor:
    """sum_k w[t, k] * (down_e glu(gate_e x + b_gate_e, up_e x + b_up_e) + b_down_e) in float32; glu None: silu(g) * u;
    a bias None: none."""
    gate, up, down = weights
    zero = torch.zeros(())
    gb, ub, db = (b if b is not None else [zero] * len(gate) for b in biases)
    out = torch.zeros(x.shape)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), topk_weights[t].tolist()):
            g, u = gate[e] @ x[t] + gb[e], up[e] @ x[t] + ub[e]
            h = glu(g, u) if glu is not None else torch.nn.functional.silu(g) * u
            out[t] += w * (down[e] @ h + db[e])
    return out


@pytest.fixture(scope="module")
def layer_data():
    """Per format: the grid weights (as packed and as float32) and the biases, drawn once."""
    cache = {}

    def get(fmt):
        if fmt not in cache:
            E, H, I = SHAPES[fmt]
            g = torch.Generator().manual_seed(11)
            experts = [tuple(grid_matrix(fmt, n, k, g) for n, k in ((I, H), (I, H), (H, I))) for _ in range(E)]
            floats = tuple(torch.stack([as_float(w) for w in ws]) for ws in zip(*experts))
            biases = (2 * torch.randn(E, I, generator=g), 2 * torch.randn(E, I, generator=g),
                      6 * torch.randn(E, H, generator=g))  # the output's scale: ~30 per value
            cache[fmt] = experts, floats, biases
        return cache[fmt]
    return get


@pytest.fixture(scope="module")
def layers(layer_data):
    """One packed layer per (format, path) with the clamped SwiGLU and the biases."""
    cache = {}

    def get(fmt, path):
        if (fmt, path) not in cache:
            experts, _, biases = layer_data(fmt)
            layer = CpuExperts.from_experts(iter(experts), len(experts), format=fmt, group_size=32, threads=2,
                                            isa=path)
            layer.set_glu(GLU)
            layer.set_biases(*biases)
            cache[fmt, path] = layer
        return cache[fmt, path]
    return get


def routing(T: int, H: int, E: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = X_SCALE * torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return x, ids, torch.rand(T, K, generator=g)


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("path", PATHS)
def test_biased_clamped_experts_match_the_fp32_reference(layers, layer_data, kernel_bound, rel_err, path, fmt, T):
    layer = layers(fmt, path)
    _, weights, biases = layer_data(fmt)
    E, H, _ = SHAPES[fmt]
    x, ids, w = routing(T, H, E, seed=T)
    out = layer.forward(x, ids, w)
    assert out.shape == (T, H) and out.dtype == torch.float32
    assert rel_err(out, reference(x, weights, biases, GLU, ids, w)) < kernel_bound(fmt, path)


@pytest.mark.parametrize("T", [4, 33])
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_clamps_and_every_bias_change_the_output_far_past_the_bound(layer_data, fmt, T):
    """The inputs above are ones where dropping a clamp or any one bias moves the reference by over ten times the
    largest bound (0.02): a kernel that drops one fails the test above."""
    _, weights, biases = layer_data(fmt)
    E, H, _ = SHAPES[fmt]
    x, ids, w = routing(T, H, E, seed=T)
    gate_x = torch.einsum("eih,th->tei", weights[0], x)[torch.arange(T)[:, None], ids] + biases[0][ids]
    up_x = torch.einsum("eih,th->tei", weights[1], x)[torch.arange(T)[:, None], ids] + biases[1][ids]
    assert (gate_x > GLU.limit).any() and (up_x > GLU.limit).any() and (up_x < -GLU.limit).any()
    ref = reference(x, weights, biases, GLU, ids, w)
    unclamped = ClampedSwiGLU(alpha=GLU.alpha, limit=math.inf)
    variants = {"no clamps": reference(x, weights, biases, unclamped, ids, w)}
    for i, name in enumerate(("gate", "up", "down")):
        dropped = tuple(None if j == i else b for j, b in enumerate(biases))
        variants[f"no {name} bias"] = reference(x, weights, dropped, GLU, ids, w)
    for name, other in variants.items():
        assert ((other - ref).norm() / ref.norm()).item() > 0.2, name


@pytest.mark.parametrize("T", [1, 33])
@pytest.mark.parametrize("path", PATHS)
def test_silu_experts_with_biases(layer_data, kernel_bound, rel_err, path, T):
    """Biases with the default activation: h = silu(gate x + b_gate) * (up x + b_up)."""
    experts, weights, biases = layer_data("int4")
    layer = CpuExperts.from_experts(iter(experts), len(experts), format="int4", group_size=32, threads=2, isa=path)
    layer.set_biases(*biases)
    assert layer.glu is None and layer.has_biases
    x, ids, w = routing(T, SHAPES["int4"][1], len(experts), seed=5)
    x /= X_SCALE
    assert rel_err(layer.forward(x, ids, w), reference(x, weights, biases, None, ids, w)) < kernel_bound("int4", path)


@pytest.mark.parametrize("path", PATHS)
def test_silu_set_again_gives_the_plain_layer_bit_for_bit(layer_data, path):
    experts, _, _ = layer_data("bf16")
    plain = CpuExperts.from_experts(iter(experts), len(experts), format="bf16", threads=2, isa=path)
    switched = CpuExperts.from_experts(iter(experts), len(experts), format="bf16", threads=2, isa=path)
    switched.set_glu(GLU)
    assert switched.glu == GLU
    switched.set_glu(None)
    assert switched.glu is None and not switched.has_biases
    x, ids, w = routing(40, SHAPES["bf16"][1], len(experts), seed=2)
    assert torch.equal(switched.forward(x / X_SCALE, ids, w), plain.forward(x / X_SCALE, ids, w))


@pytest.mark.parametrize("call, says", [
    (lambda ex: ex.set_glu(ClampedSwiGLU(alpha=1.702, limit=0.0)), "limit must be positive and finite, got 0"),
    (lambda ex: ex.set_glu(ClampedSwiGLU(alpha=math.nan, limit=7.0)), "alpha must be finite"),
    (lambda ex: ex.set_glu("clamped"), "glu must be a ClampedSwiGLU or None"),
    (lambda ex: ex.set_biases(torch.zeros(6, 71), torch.zeros(6, 72), torch.zeros(6, 200)),
     r"gate_bias has shape \[6, 71\], expected \[6, 72\]"),
    (lambda ex: ex.set_biases(torch.zeros(6, 72), torch.zeros(6, 72, dtype=torch.int32), torch.zeros(6, 200)),
     "up_bias must be a float tensor"),
], ids=["limit-zero", "alpha-nan", "not-a-glu", "gate-bias-shape", "up-bias-dtype"])
def test_bad_activation_or_biases_fail_in_one_line(layer_data, call, says):
    experts, _, _ = layer_data("bf16")
    layer = CpuExperts.from_experts(iter(experts), len(experts), format="bf16", threads=1)
    with pytest.raises(HybridMoEError, match=says) as e:
        call(layer)
    assert "\n" not in str(e.value)


def test_the_activation_and_biases_change_only_between_calls(layer_data):
    experts, _, biases = layer_data("bf16")
    layer = CpuExperts.from_experts(iter(experts), len(experts), format="bf16", threads=1)
    layer.submit(torch.zeros(1, SHAPES["bf16"][1]), torch.tensor([[0]]), torch.ones(1, 1))
    with pytest.raises(HybridMoEError, match=r"set_glu\(\) called between submit\(\) and wait\(\)"):
        layer.set_glu(GLU)
    with pytest.raises(HybridMoEError, match=r"set_biases\(\) called between submit\(\) and wait\(\)"):
        layer.set_biases(*biases)
    layer.wait()
    assert layer.glu is None and not layer.has_biases
