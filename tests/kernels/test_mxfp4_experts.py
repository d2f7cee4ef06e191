"""The mxfp4 expert format: e2m1 codes (two a byte) with one e8m0 power-of-two scale per 32 K of a row, read as
the checkpoint stores them (OCP MX FP4, gpt-oss's releases).

Every kernel path here (generic, avx2, avx512, and the AMX kernels over emulated tiles) against a float32
reference that decodes the codes and scales itself, from the spec (sign bit, 2 exponent bits of bias 1, 1
mantissa bit; scale 2^(e - 127)), with silu and with gpt-oss's clamped SwiGLU and biases. K (H and I) must be a
multiple of 32, the format's scale blocks, so the rows (I and H) are too: the shapes here are away from the tiles
in block counts (3 and 10 blocks of 32 rows), in K past the AMX kernels' chunk of 256 (H 320) and short of it (I
96), and in tokens (33 and 300: partial 16- and 32-token tiles). Every code under scales across the held range
decodes exactly on every path; packing from float follows OCP MX's rule (scale 2^(floor(log2(amax)) - 2), values
to the nearest e2m1, ties to even, saturating at 6).
"""

import math

import pytest
import torch

from hybridmoe import CpuExperts
from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.cpu_experts import available_isas
from hybridmoe.experts.mxfp4_codes import Mxfp4Codes
from hybridmoe.experts.packed_torch import PackedLayout
from hybridmoe.experts.streamed_prefill import layer_packed_bytes
from hybridmoe.layers.clamped_swiglu import ClampedSwiGLU

PATHS = available_isas() + (["amx_emulated"] if "avx512" in available_isas() else [])
E, H, I, K = 6, 320, 96, 3
GLU = ClampedSwiGLU(alpha=1.702, limit=7.0)

# Relative L2 error of the layer output against the float32 reference on the codes' own values: the kernels read
# x and h in bf16 (as the bf16 and fp8 formats do); against a reference that rounds them too, only the order of
# float32 sums differs (and a rare h rounding the other way).
TOLERANCE = {"vs_codes": 0.008, "vs_codes_bf16_acts": 2e-5, "bf16_output": 0.013}


def e2m1(code: torch.Tensor) -> torch.Tensor:
    """The OCP e2m1 value of each 4-bit code, float64: exponent field 0 is m / 2, else 2^(e - 1) (1 + m / 2)."""
    sign, e, m = (code >> 3) & 1, (code >> 1) & 3, (code & 1).double()
    magnitude = torch.where(e == 0, m / 2, 2.0 ** (e.double() - 1) * (1 + m / 2))
    return torch.where(sign == 1, -magnitude, magnitude)


def decode(w: Mxfp4Codes) -> torch.Tensor:
    """W [N, K] float32: code k of a row is byte k // 2's low nibble for even k, its high nibble for odd k; times
    2^(scale - 127) of its block of 32."""
    codes = torch.stack((w.codes & 0xF, w.codes >> 4), dim=-1).flatten(1)
    scale = (2.0 ** (w.scales.double() - 127)).repeat_interleave(32, dim=1)
    return (e2m1(codes) * scale).float()


def random_codes(n: int, k: int, g: torch.Generator, lo: int = 116, hi: int = 124) -> Mxfp4Codes:
    """Uniform codes (every value, both signs, zeros) under scales 2^(lo-127) .. 2^(hi-128): rows of norm ~1."""
    return Mxfp4Codes(torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g),
                      torch.randint(lo, hi, (n, k // 32), dtype=torch.uint8, generator=g))


def reference(x, weights, ids, topk_weights, glu=None, biases=None, bf16_acts=False) -> torch.Tensor:
    """sum_k w[t, k] (down_e act(gate_e x + b_gate, up_e x + b_up) + b_down) in float32; act silu(g) * u unless glu;
    bf16_acts: x and h rounded to bf16 first, as the kernels read them."""
    gate, up, down = weights
    gb, ub, db = biases if biases is not None else (torch.zeros(E, I), torch.zeros(E, I), torch.zeros(E, H))
    x = x.bfloat16().float() if bf16_acts else x
    out = torch.zeros(x.shape)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), topk_weights[t].tolist()):
            g, u = gate[e] @ x[t] + gb[e], up[e] @ x[t] + ub[e]
            h = glu(g, u) if glu is not None else torch.nn.functional.silu(g) * u
            h = h.bfloat16().float() if bf16_acts else h
            out[t] += w * (down[e] @ h + db[e])
    return out


@pytest.fixture(scope="module")
def codes():
    """Every expert's (gate, up, down) as MXFP4 codes and scales."""
    g = torch.Generator().manual_seed(0)
    return [tuple(random_codes(n, k, g) for n, k in ((I, H), (I, H), (H, I))) for _ in range(E)]


@pytest.fixture(scope="module")
def weights(codes):
    return tuple(torch.stack([decode(c[m]) for c in codes]) for m in range(3))


@pytest.fixture(scope="module")
def biases():
    g = torch.Generator().manual_seed(2)
    return 2 * torch.randn(E, I, generator=g), 2 * torch.randn(E, I, generator=g), 6 * torch.randn(E, H, generator=g)


@pytest.fixture(scope="module")
def layers(codes, biases):
    """Per path: a silu layer and a clamped-SwiGLU layer with biases, both packed from the codes as they are."""
    out = {}
    for path in PATHS:
        plain = CpuExperts.from_experts(iter(codes), E, format="mxfp4", threads=2, isa=path)
        gpt_oss = CpuExperts.from_experts(iter(codes), E, format="mxfp4", threads=2, isa=path)
        gpt_oss.set_glu(GLU)
        gpt_oss.set_biases(*biases)
        out[path] = plain, gpt_oss
    return out


def routing(T: int, seed: int, x_scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return x_scale * torch.randn(T, H, generator=g), ids, torch.rand(T, K, generator=g)


@pytest.mark.parametrize("T", [1, 4, 33, 300])
@pytest.mark.parametrize("path", PATHS)
def test_silu_layer_matches_the_fp32_reference_on_the_codes(layers, weights, rel_err, path, T):
    experts = layers[path][0]
    assert (experts.format, experts.isa) == ("mxfp4", path)
    x, ids, w = routing(T, seed=T)
    out = experts.forward(x, ids, w)
    assert out.shape == (T, H) and out.dtype == torch.float32
    assert rel_err(out, reference(x, weights, ids, w)) < TOLERANCE["vs_codes"]
    assert rel_err(out, reference(x, weights, ids, w, bf16_acts=True)) < TOLERANCE["vs_codes_bf16_acts"]


@pytest.mark.parametrize("T", [1, 4, 33, 300])
@pytest.mark.parametrize("path", PATHS)
def test_clamped_swiglu_with_biases_matches_the_fp32_reference(layers, weights, biases, rel_err, path, T):
    """x of scale 8: gate x and up x pass the limit 7 on both sides often enough that a dropped clamp or bias shows."""
    x, ids, w = routing(T, seed=100 + T, x_scale=8.0)
    out = layers[path][1].forward(x, ids, w)
    ref = reference(x, weights, ids, w, GLU, biases)
    assert rel_err(out, ref) < TOLERANCE["vs_codes"]
    assert rel_err(out, reference(x, weights, ids, w, GLU, biases, bf16_acts=True)) < TOLERANCE["vs_codes_bf16_acts"]
    unclamped = reference(x, weights, ids, w, ClampedSwiGLU(alpha=GLU.alpha, limit=math.inf), biases)
    assert rel_err(unclamped, ref) > 10 * TOLERANCE["vs_codes"]


@pytest.mark.parametrize("path", PATHS)
def test_bf16_input_gives_bf16_output(layers, weights, rel_err, path):
    x, ids, w = routing(40, seed=3)
    out = layers[path][0].forward(x.bfloat16(), ids, w)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, reference(x.bfloat16().float(), weights, ids, w)) < TOLERANCE["bf16_output"]


def test_packed_codes_are_the_checkpoints_bit_for_bit(codes, layers):
    for e in range(E):
        for got, want in zip(layers[PATHS[0]][0].dequantized(e), codes[e]):
            assert torch.equal(got.view(torch.int32), decode(want).view(torch.int32))


def held_range_layer(path: str) -> tuple[CpuExperts, torch.Tensor, torch.Tensor]:
    """One expert, H = I = 256, that turns x = e_c into out[m] = 64 x E2M1[(m + c) % 16] x 2^(g % 3 - 1), g = c // 32:
    gate is 4 x 2^4 everywhere (gate x = 64, silu(64) = 64 in float32), up[m, c] holds code (m + c) % 16 under
    scale base_m + g % 3 - 1 (base_m from 3 to 239: up's scales span 2..240 across rows and blocks), down[m, m] is
    1.0 under scale 254 - base_m (15..251), its other blocks all zero under random scale bytes 0..255 (which
    packing sets aside). Every product is a power of two times an e2m1 value: exact in float32 and in the bf16 h.
    Returns the layer, base and the down scales."""
    n, groups = 256, 8
    base = 3 + torch.arange(n) * 236 // (n - 1)
    col = torch.arange(n)
    gate = Mxfp4Codes(torch.full((n, n // 2), 0x66, dtype=torch.uint8), torch.full((n, groups), 131, dtype=torch.uint8))
    up_codes = ((col[:, None] + col[None, :]) % 16).to(torch.uint8)  # [m, c]
    up = Mxfp4Codes(up_codes[:, 0::2] | up_codes[:, 1::2] << 4,
                    (base[:, None] + torch.arange(groups) % 3 - 1).to(torch.uint8))
    down_codes = torch.zeros(n, n, dtype=torch.uint8)
    down_codes[col, col] = 2  # 1.0
    down_scales = torch.randint(0, 256, (n, groups), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    down_scales[col, col // 32] = (254 - base).to(torch.uint8)
    down = Mxfp4Codes(down_codes[:, 0::2] | down_codes[:, 1::2] << 4, down_scales)
    return CpuExperts.from_experts([(gate, up, down)], 1, format="mxfp4", threads=2, isa=path), base, down_scales


@pytest.mark.parametrize("T", [1, 33])
@pytest.mark.parametrize("path", PATHS)
def test_every_code_under_scales_across_the_held_range_decodes_exactly(path, T):
    experts = held_range_layer(path)[0]
    c = (torch.arange(T) * 37 + 5) % 256  # token t reads column c[t]: every position in a step, every block
    x = torch.zeros(T, 256)
    x[torch.arange(T), c] = 1.0
    out = experts.forward(x, torch.zeros(T, 1, dtype=torch.long), torch.ones(T, 1))
    m = torch.arange(256)
    want = 64 * e2m1((m[None, :] + c[:, None]) % 16) * 2.0 ** ((c[:, None] // 32) % 3 - 1)
    assert torch.equal(out, want.float()), (out - want).abs().argmax()


def test_scales_of_zero_blocks_are_set_aside_and_the_others_kept():
    experts, _, down_scales = held_range_layer(PATHS[0])
    held = torch.from_numpy(experts.packed_state()["buffers"]["down.0.scale"]).view(8, 8, 32)  # [block][group][row]
    rows = torch.arange(256)
    want = torch.full((256, 8), 127, dtype=torch.uint8)
    want[rows, rows // 32] = down_scales[rows, rows // 32]
    assert torch.equal(held.permute(0, 2, 1).reshape(256, 8), want)


def ocp_quantize(w: torch.Tensor) -> Mxfp4Codes:
    """w [N, K] float32 -> MXFP4 per OCP MX v1.0, written independently of the engine: per 32 values, shared
    exponent floor(log2(amax)) - 2 (the exponent of e2m1's largest value, 6), each value over 2^shared rounded to
    the nearest e2m1 value (ties to the even code), magnitudes past 6 to 6, the sign kept; an all-zero block at
    scale 2^0. The shared exponent is clamped to the scales the engine holds, -125..125 (a block under 2^-123)."""
    n, k = w.shape
    blocks = w.double().view(n, k // 32, 32)
    amax = blocks.abs().amax(dim=-1)
    shared = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(1e-300))) - 2, torch.zeros_like(amax))
    shared = shared.clamp(-125, 125)
    q = blocks / 2.0 ** shared[..., None]
    grid = e2m1(torch.arange(8))  # 0 .. 6
    dist = (q.abs()[..., None] - grid).abs()
    nearest = dist.min(dim=-1, keepdim=True).values
    tie_even = torch.where(dist == nearest, torch.arange(8) % 2, 2)  # among the nearest, the even code
    mag = tie_even.argmin(dim=-1)
    code = (mag | (torch.signbit(q).long() << 3)).view(n, k).to(torch.uint8)
    return Mxfp4Codes(code[:, 0::2] | code[:, 1::2] << 4, (shared + 127).to(torch.uint8))


def test_packing_from_float_follows_the_ocp_rule():
    g = torch.Generator().manual_seed(1)
    gate, up = torch.randn(2, I, H, generator=g), torch.randn(2, I, H, generator=g) * 1e-30
    down = torch.randn(2, H, I, generator=g) * 3e4
    down[1, 64:96, :] = 0  # all-zero blocks
    up[1, 5, :] = torch.linspace(-4e-38, 4e-38, H)  # blocks under 2^-123: scale 2^-125
    # the e2m1 midpoints and values past 6, in a block whose amax is 7.5 (shared exponent 0)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 7.5])
    gate[0, 0, :18] = torch.cat([mids, -mids])
    experts = CpuExperts(gate, up, down.bfloat16(), format="mxfp4", threads=2, isa=PATHS[0])
    for e in range(2):
        for got, w in zip(experts.dequantized(e), (gate[e], up[e], down[e].bfloat16().float())):
            assert torch.equal(got, decode(ocp_quantize(w)))
    assert experts.dequantized(0)[0][0, :9].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0]


def test_float_weights_from_mxfp4_codes_pack_back_to_the_same_values(codes):
    """An MXFP4 block's values over their own OCP scale are e2m1 values again: float -> mxfp4 loses nothing."""
    dense = CpuExperts.from_experts(([decode(c) for c in expert] for expert in codes), E, format="mxfp4", threads=2)
    for e in range(E):
        for got, want in zip(dense.dequantized(e), codes[e]):
            assert torch.equal(got, decode(want))


def test_the_packed_layout_and_from_packed_read_what_the_engine_holds(codes):
    experts = CpuExperts.from_experts(iter(codes), E, format="mxfp4", threads=2, numa_nodes=2)
    state = experts.packed_state()
    layout = PackedLayout(state)
    assert layout.buffer_bytes() == {n: b.nbytes for n, b in state["buffers"].items()}
    assert sum(layout.buffer_bytes().values()) <= layer_packed_bytes("mxfp4", E, H, I, 128, False)
    buffers = {n: torch.from_numpy(b).view(torch.uint8).reshape(-1) for n, b in state["buffers"].items()}
    ids = torch.tensor([4, 0])
    for got, m in zip(layout.dequantize(buffers, ids, torch.float32), range(3)):
        assert torch.equal(got, torch.stack([decode(codes[int(e)][m]) for e in ids]))
    adopted = CpuExperts.from_packed(state, threads=2)  # the e8m0 bytes used in place
    x, ids, w = routing(5, seed=9)
    assert torch.equal(adopted.forward(x, ids, w), experts.forward(x, ids, w))


@pytest.mark.parametrize("scale", [0, 1, 253, 255])
def test_a_scale_outside_the_held_range_is_refused_naming_the_expert_and_matrix(codes, scale):
    gate, up, down = codes[0]
    bad = down.scales.clone()
    bad[70, 2] = scale
    with pytest.raises(HybridMoEError, match=f"expert 1's down scale {scale} at row 70, block 2 is outside 2..252"):
        CpuExperts.from_experts([codes[1], (gate, up, Mxfp4Codes(down.codes, bad))], 2, format="mxfp4", threads=2)


def test_codes_of_the_wrong_shape_are_refused(codes):
    gate, up, down = codes[0]
    with pytest.raises(HybridMoEError, match="down codes and scales must be uint8"):
        CpuExperts.from_experts([(gate, up, Mxfp4Codes(down.codes, down.scales[:, :1]))], 1, format="mxfp4",
                                threads=2)


def test_sizes_that_are_not_multiples_of_32_are_refused():
    with pytest.raises(HybridMoEError, match="mxfp4 needs hidden size and intermediate size divisible by 32"):
        CpuExperts(torch.zeros(1, 48, 64), torch.zeros(1, 48, 64), torch.zeros(1, 64, 48), format="mxfp4")


def test_codes_go_through_float_into_another_format(codes):
    int8 = CpuExperts.from_experts(iter(codes), E, format="int8", threads=2)
    reference_layer = CpuExperts.from_experts(([decode(c) for c in expert] for expert in codes), E, format="int8",
                                              threads=2)
    for e in range(E):
        for got, want in zip(int8.dequantized(e), reference_layer.dequantized(e)):
            assert torch.equal(got, want)
