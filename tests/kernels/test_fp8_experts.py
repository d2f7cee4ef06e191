"""The fp8 expert format: e4m3 codes with one float32 scale per 128x128 block, read as they are.

Every kernel path here (generic, avx2, avx512, and the AMX kernels over emulated tiles) against an fp32
reference that decodes the codes with torch's float8_e4m3fn (experts/fp8_codes.py), on shapes that are not
multiples of 128 nor of 32 (the format pads K to 32 like bf16; blocks of 32 rows take the scale of the
128-row block they lie in). Packing from float quantizes per 128x128 block (amax / 448) to the codes torch's
cast gives; the 254 finite codes decode exactly in every path.
"""

import pytest
import torch

from hybridmoe import CpuExperts
from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.cpu_experts import available_isas
from hybridmoe.experts.fp8_codes import FP8_BLOCK, Fp8Codes
from hybridmoe.experts.packed_torch import PackedLayout
from hybridmoe.experts.streamed_prefill import layer_packed_bytes
from hybridmoe.experts.torch_ref import ref_moe

PATHS = available_isas() + (["amx_emulated"] if "avx512" in available_isas() else [])
E, H, I, K = 6, 300, 136, 3  # H: 3 blocks of K (the last 44 wide), 10 blocks of 32 rows; I: 2 and 5
FP8_MAX = 448.0

# Relative L2 error of the layer output against the fp32 reference on the codes' own values: the kernels
# round x and h to bf16 (as the bf16 format does); against a reference that rounds them too, only the
# order of fp32 sums differs (and a rare h rounding the other way).
TOLERANCE = {"vs_codes": 0.008, "vs_codes_bf16_acts": 2e-4, "bf16_output": 0.013}


def quantize_blocks(w: torch.Tensor) -> Fp8Codes:
    """w [N, K] float32 -> e4m3 codes with scale amax / 448 per 128x128 block (DeepSeek-V3's scheme; an
    all-zero block gets scale 0 and zero codes), written independently of the engine."""
    rows, cols = -(-w.shape[0] // FP8_BLOCK), -(-w.shape[1] // FP8_BLOCK)
    scale = torch.empty(rows, cols)
    codes = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            r, c = slice(i * FP8_BLOCK, (i + 1) * FP8_BLOCK), slice(j * FP8_BLOCK, (j + 1) * FP8_BLOCK)
            scale[i, j] = w[r, c].abs().max() / FP8_MAX
            q = w[r, c] / scale[i, j] if scale[i, j] > 0 else torch.zeros_like(w[r, c])
            codes[r, c] = q.to(torch.float8_e4m3fn)
    return Fp8Codes(codes, scale)


def dequantize(c: Fp8Codes) -> torch.Tensor:
    """The reference's weights: each code decoded by torch, times its block's scale, in float32."""
    scale = c.scale.repeat_interleave(FP8_BLOCK, 0)[:c.codes.shape[0]].repeat_interleave(FP8_BLOCK, 1)
    return c.codes.float() * scale[:, :c.codes.shape[1]]


def ref_bf16_acts(x, gate, up, down, ids, weights) -> torch.Tensor:
    """ref_moe with x and h = silu(gate x) * up x rounded to bf16, as the kernels read them."""
    x, out = x.bfloat16().float(), torch.zeros(x.shape)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t].tolist()):
            h = (torch.nn.functional.silu(gate[e] @ x[t]) * (up[e] @ x[t])).bfloat16().float()
            out[t] += w * (down[e] @ h)
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.fixture(scope="module")
def codes():
    """Every expert's (gate, up, down) as block-FP8 codes, from Gaussian weights."""
    g = torch.Generator().manual_seed(0)
    return [tuple(quantize_blocks(torch.randn(n, k, generator=g) / k**0.5) for n, k in ((I, H), (I, H), (H, I)))
            for _ in range(E)]


@pytest.fixture(scope="module")
def layers(codes):
    """One fp8 layer per path, packed from the codes as they are."""
    return {path: CpuExperts.from_experts(iter(codes), E, format="fp8", threads=2, isa=path) for path in PATHS}


def routing(T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return torch.randn(T, H, generator=g), ids, torch.rand(T, K, generator=g)


@pytest.mark.parametrize("T", [1, 4, 33, 300])
@pytest.mark.parametrize("path", PATHS)
def test_layer_matches_the_fp32_reference_on_the_codes(codes, layers, path, T):
    experts = layers[path]
    assert (experts.format, experts.isa) == ("fp8", path)
    gate, up, down = (torch.stack([dequantize(c[m]) for c in codes]) for m in range(3))
    x, ids, weights = routing(T, seed=T)
    out = experts.forward(x, ids, weights)
    assert out.shape == (T, H) and out.dtype == torch.float32
    assert rel_err(out, ref_moe(x, gate, up, down, ids, weights)) < TOLERANCE["vs_codes"]
    assert rel_err(out, ref_bf16_acts(x, gate, up, down, ids, weights)) < TOLERANCE["vs_codes_bf16_acts"]


@pytest.mark.parametrize("path", PATHS)
def test_bf16_input_gives_bf16_output(codes, layers, path):
    gate, up, down = (torch.stack([dequantize(c[m]) for c in codes]) for m in range(3))
    x, ids, weights = routing(40, seed=3)
    out = layers[path].forward(x.bfloat16(), ids, weights)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref_moe(x.bfloat16(), gate, up, down, ids, weights)) < TOLERANCE["bf16_output"]


def test_packed_codes_are_the_checkpoints_bit_for_bit(codes, layers):
    for e in range(E):
        for got, want in zip(layers[PATHS[0]].dequantized(e), codes[e]):
            assert torch.equal(got, dequantize(want))


def e4m3_layer(path: str, up_scale: torch.Tensor, down_scale: torch.Tensor) -> CpuExperts:
    """One expert, H = I = 256, that turns x = e_0 into out[j] = 64 x value(code j) x up_scale x down_scale:
    gate's column 0 is 64 (silu(64) = 64 in fp32), up's column 0 holds code j in row j (the NaN codes 0x7f
    and 0xff: 0), down is the identity. Every product is a power of two times a code's value: exact in fp32
    and in the bf16 h."""
    n = 256
    gate = torch.zeros(n, n, dtype=torch.uint8)
    gate[:, 0] = 0x68  # 2^6
    up = torch.zeros(n, n, dtype=torch.uint8)
    up[:, 0] = torch.arange(n, dtype=torch.uint8)
    up[0x7F, 0] = up[0xFF, 0] = 0
    down = torch.diag(torch.full((n,), 0x38, dtype=torch.uint8))  # 1.0
    mats = [Fp8Codes(m.view(torch.float8_e4m3fn), s) for m, s in ((gate, torch.ones(2, 2)), (up, up_scale),
                                                                     (down, down_scale))]
    return CpuExperts.from_experts([tuple(mats)], 1, format="fp8", threads=2, isa=path)


@pytest.mark.parametrize("T", [1, 33])
@pytest.mark.parametrize("path", PATHS)
def test_every_finite_e4m3_code_decodes_exactly(path, T):
    up_scale = torch.tensor([[0.5, 8.0], [2.0, 0.25]])  # rows 0-127 / 128-255; column 0 is in block 0
    down_scale = torch.tensor([[4.0, 0.125], [1.0, 0.5]])  # out j < 128 reads h j in column block 0
    experts = e4m3_layer(path, up_scale, down_scale)
    x = torch.zeros(T, 256)
    x[:, 0] = 1.0
    out = experts.forward(x, torch.zeros(T, 1, dtype=torch.long), torch.ones(T, 1))
    codes = torch.arange(256, dtype=torch.uint8)
    codes[0x7F] = codes[0xFF] = 0
    value = codes.view(torch.float8_e4m3fn).float()
    scale = torch.cat([torch.full((128,), 0.5 * 4.0), torch.full((128,), 2.0 * 0.5)])
    want = 64.0 * value * scale
    assert torch.equal(out, want.expand(T, -1)), (out[0] - want).abs().argmax()


def test_packing_from_float_gives_torchs_codes_per_128x128_block():
    g = torch.Generator().manual_seed(1)
    gate, up = torch.randn(2, I, H, generator=g), torch.randn(2, I, H, generator=g) * 1e-3
    down = torch.randn(2, H, I, generator=g) * 30
    down[1, 128:256, :] = 0  # an all-zero block row: scale 0
    # ties and the subnormal range: a block whose amax is 448 (scale 1) holds midpoints between e4m3 values
    codes = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (codes[1:] + codes[:-1]) / 2
    gate[0, :2, :mids.numel()] = torch.stack([mids, -mids])
    gate[0, 0, 127] = FP8_MAX
    experts = CpuExperts(gate, up, down.bfloat16(), format="fp8", threads=2, isa=PATHS[0])
    for e in range(2):
        for got, w in zip(experts.dequantized(e), (gate[e], up[e], down[e].bfloat16().float())):
            assert torch.equal(got, dequantize(quantize_blocks(w)))


def test_fp8_packed_layout_reads_what_the_engine_holds(codes):
    experts = CpuExperts.from_experts(iter(codes), E, format="fp8", threads=2, numa_nodes=2)
    state = experts.packed_state()
    layout = PackedLayout(state)
    assert layout.buffer_bytes() == {n: b.nbytes for n, b in state["buffers"].items()}
    assert sum(layout.buffer_bytes().values()) <= layer_packed_bytes("fp8", E, H, I, 128, False)
    buffers = {n: torch.from_numpy(b).view(torch.uint8).reshape(-1) for n, b in state["buffers"].items()}
    ids = torch.tensor([4, 0])
    for got, m in zip(layout.dequantize(buffers, ids, torch.float32), range(3)):
        assert torch.equal(got, torch.stack([experts.dequantized(int(e))[m] for e in ids]))


@pytest.mark.parametrize("row,col,code", [(5, 7, 0xFF), (299, 135, 0x7F), (40, 130, 0xFF)])
def test_a_nan_code_is_refused_naming_the_expert_and_matrix(codes, row, col, code):
    # (5, 7) in the copy of whole blocks 16 K at a time; the others in a partial block, or past the last 16 K
    gate, up, down = codes[0]
    bad = down.codes.clone()
    bad.view(torch.uint8)[row, col] = code
    with pytest.raises(HybridMoEError, match=f"expert 1's down code {code} at {row * I + col} is NaN in e4m3"):
        CpuExperts.from_experts([codes[1], (gate, up, Fp8Codes(bad, down.scale))], 2, format="fp8", threads=2)


def test_codes_of_the_wrong_shape_are_refused(codes):
    gate, up, down = codes[0]
    with pytest.raises(HybridMoEError, match="scales must be"):
        CpuExperts.from_experts([(gate, up, Fp8Codes(down.codes, down.scale[:1]))], 1, format="fp8", threads=2)


def test_codes_go_through_float_into_another_format(codes):
    int8 = CpuExperts.from_experts(iter(codes), E, format="int8", threads=2)
    reference = CpuExperts.from_experts(([dequantize(c) for c in expert] for expert in codes), E, format="int8",
                                        threads=2)
    for e in range(E):
        for got, want in zip(int8.dequantized(e), reference.dequantized(e)):
            assert torch.equal(got, want)
