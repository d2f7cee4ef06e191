"""The AMX kernels' tiling, repacking and activation quantization, on CPUs without AMX.

isa="amx_emulated" runs amx_kernels.inc over tile registers emulated in memory (experts with
>= 16 tokens; the others take the AVX-512 kernels, as on the AMX host). Shapes are not tile
multiples: bf16/int8 pad K=200 to 224 (and int8 gate/up to 256, a whole AMX-INT8 step), I=72
is 3 blocks of 32 rows with the last one partial; int4 runs H=192, I=96 (groups of 32). int8
reads x in int8 with one scale per token and h with one per (token, 128 K): the shapes with
I > 128 (several groups, a partial last one) are where the second matters.
"""

import pytest
import torch

from hybridmoe import CpuExperts
from hybridmoe.experts.cpu_experts import available_isas
from hybridmoe.experts.torch_ref import ref_moe

pytestmark = pytest.mark.skipif("avx512" not in available_isas(), reason="the emulation is built on AVX-512")

SHAPES = {"bf16": (6, 200, 72), "int8": (6, 200, 72), "int4": (6, 192, 96)}
K = 3


@pytest.fixture(scope="module")
def packed(dequantized_layer):
    cache = {}

    def get(fmt):
        if fmt not in cache:
            E, H, I = SHAPES[fmt]
            g = torch.Generator().manual_seed(0)
            w = (torch.randn(E, I, H, generator=g) / H**0.5, torch.randn(E, I, H, generator=g) / H**0.5,
                 torch.randn(E, H, I, generator=g) / I**0.5)
            ex = CpuExperts(*w, format=fmt, group_size=32, threads=2, isa="amx_emulated")
            cache[fmt] = (w, ex, dequantized_layer(ex))
        return cache[fmt]
    return get


@pytest.mark.parametrize("T", [33, 47, 300])
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_emulated_amx_matches_reference(packed, make_routing, tolerance, kernel_bound, rel_err, fmt, T):
    (gate, up, down), experts, deq = packed(fmt)
    assert experts.isa == "amx_emulated"
    E, H, I = SHAPES[fmt]
    # Expert E-1 gets no tokens; the others 16..180 each (odd counts: partial 16- and 32-token tiles).
    x, ids, weights = make_routing(T, H, K, range(E - 1), seed=T)
    out = experts.forward(x, ids, weights)
    assert rel_err(out, ref_moe(x, *deq, ids, weights)) < kernel_bound(fmt, "amx_emulated")
    vs_fp32 = tolerance[fmt]["vs_fp32"][32] if fmt == "int4" else tolerance[fmt]["vs_fp32"]
    assert rel_err(out, ref_moe(x, gate, up, down, ids, weights)) < vs_fp32


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_emulated_amx_mixed_with_avx512_experts(packed, make_routing, kernel_bound, rel_err, fmt):
    # Expert 0 takes all 40 tokens (tiles); the second choices spread 8 or so per expert (AVX-512).
    _, experts, deq = packed(fmt)
    E, H, I = SHAPES[fmt]
    x, ids, weights = make_routing(40, H, 2, range(1, E), seed=5)
    ids[:, 0] = 0
    out = experts.forward(x, ids, weights)
    assert rel_err(out, ref_moe(x, *deq, ids, weights)) < kernel_bound(fmt, "amx_emulated")


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_emulated_amx_bf16_input(packed, make_routing, kernel_bound, rel_err, fmt):
    _, experts, deq = packed(fmt)
    E, H, I = SHAPES[fmt]
    x, ids, weights = make_routing(64, H, K, range(E), seed=3)
    x = x.bfloat16()
    out = experts.forward(x, ids, weights)
    assert out.dtype == torch.bfloat16
    # Output rounding to bf16 adds up to ~0.4% on top of the kernel's own error.
    assert rel_err(out, ref_moe(x, *deq, ids, weights)) < kernel_bound(fmt, "amx_emulated") + 0.005


def test_emulated_amx_is_never_picked_or_listed():
    assert "amx_emulated" not in available_isas()
    w = torch.randn(2, 32, 64), torch.randn(2, 32, 64), torch.randn(2, 64, 32)
    assert CpuExperts(*w, threads=1).isa != "amx_emulated"


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_emulated_amx_many_chunks_and_panels(make_weights, kernel_bound, rel_err, dequantized_layer, fmt):
    # H = 2112: several K chunks with a partial last one in every source (bf16 in place: 256 values;
    # int4 dequantized: 1024; int8 quads: 512; int8 down, I = 320: 512 with groups of 128), and
    # 270 tokens on expert 0: token panels of 256 + 14 (int4: the next chunk's A tiles prefetched
    # across the panels' boundary).
    E, H, T = 2, 2112, 300
    I = {"bf16": 72, "int8": 320, "int4": 96}[fmt]
    gate, up, down = make_weights(E, H, I)
    experts = CpuExperts(gate, up, down, format=fmt, group_size=32, threads=2, isa="amx_emulated")
    g = torch.Generator().manual_seed(9)
    x = torch.randn(T, H, generator=g)
    ids = (torch.arange(T) >= 270).long().reshape(T, 1)
    weights = torch.rand(T, 1, generator=g)
    out = experts.forward(x, ids, weights)
    assert rel_err(out, ref_moe(x, *dequantized_layer(experts), ids, weights)) < kernel_bound(fmt, "amx_emulated")


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_emulated_amx_error_at_qwen3_shape(make_weights, tolerance, kernel_bound, rel_err, dequantized_layer, fmt):
    # The table's bounds at a real width (H 2048, I 768), where int8 activations lose the most.
    E, H, I, T = 2, 2048, 768, 64
    gate, up, down = make_weights(E, H, I)
    experts = CpuExperts(gate, up, down, format=fmt, group_size=128, threads=2, isa="amx_emulated")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(T, H, generator=g)
    ids = torch.arange(T).remainder(E).reshape(T, 1)
    weights = torch.rand(T, 1, generator=g)
    out = experts.forward(x, ids, weights)
    assert rel_err(out, ref_moe(x, *dequantized_layer(experts), ids, weights)) < kernel_bound(fmt, "amx_emulated")
    vs_fp32 = tolerance[fmt]["vs_fp32"][128] if fmt == "int4" else tolerance[fmt]["vs_fp32"]
    assert rel_err(out, ref_moe(x, gate, up, down, ids, weights)) < vs_fp32


@pytest.mark.parametrize("group", [32, 128])
def test_emulated_amx_int4_zero_points(make_weights, kernel_bound, rel_err, dequantized_layer, group):
    # Asymmetric groups: (q - z) s per group in the dequantized B chunks; several groups per K
    # chunk (32) and groups of several tile steps (128).
    E, H, I, T = 2, 512, 256, 40
    gate, up, down = make_weights(E, H, I)
    experts = CpuExperts(gate, up, down, format="int4", group_size=group, zero_points=True, threads=2,
                         isa="amx_emulated")
    g = torch.Generator().manual_seed(6)
    x = torch.randn(T, H, generator=g) + 0.5  # a mean: the zero-point term is large
    ids = torch.arange(T).remainder(E).reshape(T, 1)
    weights = torch.rand(T, 1, generator=g)
    out = experts.forward(x, ids, weights)
    assert rel_err(out, ref_moe(x, *dequantized_layer(experts), ids, weights)) < kernel_bound("int4", "amx_emulated")


def test_emulated_amx_int8_down_scales_each_group_of_h(kernel_bound, rel_err, dequantized_layer):
    # h's first 128 columns are ~100x the others (gate/up rows x10) and down's matching columns
    # /100, so every group of h carries a like share of the output: one scale per token would
    # round the small groups to zero (rel. error 0.48); one per (token, 128 K) keeps them.
    E, H, I, T = 1, 256, 320, 40
    g = torch.Generator().manual_seed(11)
    big = torch.ones(I)
    big[:128] = 10
    gate = torch.randn(E, I, H, generator=g) / H**0.5 * big[:, None]
    up = torch.randn(E, I, H, generator=g) / H**0.5 * big[:, None]
    down = torch.randn(E, H, I, generator=g) / I**0.5 / big**2
    experts = CpuExperts(gate, up, down, format="int8", threads=2, isa="amx_emulated")
    x = torch.randn(T, H, generator=g)
    ids, weights = torch.zeros(T, 1, dtype=torch.long), torch.rand(T, 1, generator=g)
    out = experts.forward(x, ids, weights)
    ref = ref_moe(x, *dequantized_layer(experts), ids, weights)
    assert rel_err(out, ref) < kernel_bound("int8", "amx_emulated")
