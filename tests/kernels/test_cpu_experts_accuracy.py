"""Every format x every ISA path here x token counts, on shapes that are not tile multiples.

Blocks are 32 rows and bf16/int8 pad K to 32: H=200 and I=72 exercise every padding path;
int4 needs H and I divisible by the group, so it runs H=192, I=96 (3 groups of 32 per row).
"""

import pytest
import torch

from hybridmoe import CpuExperts
from hybridmoe.experts.torch_ref import ref_moe

TOKENS = [1, 2, 4, 5, 17, 128, 300]
SHAPES = {"bf16": (6, 200, 72), "int8": (6, 200, 72), "int4": (6, 192, 96)}
K = 3


@pytest.fixture(scope="module")
def packed(dequantized_layer):
    """One packed layer per (format, isa): packing once keeps the suite fast."""
    cache = {}

    def get(fmt, isa):
        if (fmt, isa) not in cache:
            E, H, I = SHAPES[fmt]
            g = torch.Generator().manual_seed(0)
            w = (torch.randn(E, I, H, generator=g) / H**0.5, torch.randn(E, I, H, generator=g) / H**0.5,
                 torch.randn(E, H, I, generator=g) / I**0.5)
            ex = CpuExperts(*w, format=fmt, group_size=32, threads=2, isa=isa)
            cache[fmt, isa] = (w, ex, dequantized_layer(ex))
        return cache[fmt, isa]
    return get


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_layer_matches_fp32_reference(packed, make_routing, tolerance, kernel_bound, rel_err, fmt, isa, T):
    (gate, up, down), experts, deq = packed(fmt, isa)
    E, H, I = SHAPES[fmt]
    x, ids, weights = make_routing(T, H, K, range(E), seed=T)
    out = experts.forward(x, ids, weights)
    assert out.shape == (T, H) and out.dtype == torch.float32
    tol = tolerance[fmt]
    assert rel_err(out, ref_moe(x, *deq, ids, weights)) < kernel_bound(fmt, isa)
    vs_fp32 = tol["vs_fp32"][32] if fmt == "int4" else tol["vs_fp32"]
    assert rel_err(out, ref_moe(x, gate, up, down, ids, weights)) < vs_fp32


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_bf16_input_gives_bf16_output(packed, make_routing, kernel_bound, rel_err, fmt, isa):
    _, experts, deq = packed(fmt, isa)
    E, H, I = SHAPES[fmt]
    x, ids, weights = make_routing(9, H, K, range(E))
    x = x.bfloat16()
    out = experts.forward(x, ids, weights)
    assert out.dtype == torch.bfloat16
    # Output rounding to bf16 adds up to ~0.4% on top of the kernel's own error.
    assert rel_err(out, ref_moe(x, *deq, ids, weights)) < kernel_bound(fmt, isa) + 0.005
