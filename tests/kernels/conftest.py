"""Shared inputs for the native expert kernel tests.

Shapes: T tokens, K experts per token, E experts, H hidden, I expert intermediate size.
"""

import pytest
import torch

from hybridmoe.experts.cpu_experts import available_isas


def pytest_generate_tests(metafunc):
    """A test that takes `isa` runs once on every kernel path this machine has."""
    if "isa" in metafunc.fixturenames:
        metafunc.parametrize("isa", available_isas())


# Relative L2 error of the layer output: vs the fp32 reference on the weights the kernel
# holds (what the kernel adds) and vs the original fp32 weights (what the format costs).
# int4 vs fp32 is round-to-nearest on Gaussian weights, per group size. AMX's int8 reads int8
# activations (AMX-INT8; amax / 127 per token for x, per (token, 128 K) for h), which add 1.5-1.85%
# at H 192..7168 (vs fp32: 0.020-0.024) where the other paths' int16 activations add ~1e-4: its
# own bound vs the held weights.
# fp8 (test_fp8_experts.py's own table has its details): x and h read in bf16, as bf16's.
TOLERANCE = {
    "bf16": {"vs_dequantized": 0.008, "vs_fp32": 0.008},
    "fp8": {"vs_dequantized": 0.008},
    "int8": {"vs_dequantized": 0.01, "vs_dequantized_int8_activations": 0.02, "vs_fp32": 0.03},
    "int4": {"vs_dequantized": 0.01, "vs_fp32": {32: 0.19, 64: 0.21, 128: 0.24}},
}


@pytest.fixture(scope="session")
def tolerance():
    return TOLERANCE


@pytest.fixture(scope="session")
def kernel_bound():
    """kernel_bound(fmt, isa): the bound vs the held weights. Experts with many tokens on the AMX
    paths ("amx", "amx_emulated") read int8 activations in int8 (AMX-INT8): the table's bound for
    that; every other path (and format) the plain vs_dequantized bound."""
    def bound(fmt: str, isa: str) -> float:
        tol = TOLERANCE[fmt]
        return tol["vs_dequantized_int8_activations"] if fmt == "int8" and isa.startswith("amx") else tol["vs_dequantized"]
    return bound


@pytest.fixture(scope="session")
def rel_err():
    def err(out: torch.Tensor, ref: torch.Tensor) -> float:
        return ((out.float() - ref).norm() / ref.norm()).item()
    return err


@pytest.fixture
def make_weights():
    """Gaussian expert weights scaled so every layer keeps unit-size activations."""
    def make(E, H, I, seed=0):
        g = torch.Generator().manual_seed(seed)
        gate = torch.randn(E, I, H, generator=g) / H**0.5
        up = torch.randn(E, I, H, generator=g) / H**0.5
        down = torch.randn(E, H, I, generator=g) / I**0.5
        return gate, up, down
    return make


@pytest.fixture
def make_routing():
    """x [T, H], distinct ids [T, K] drawn from `experts`, positive weights [T, K]."""
    def make(T, H, K, experts, seed=1):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(T, H, generator=g)
        experts = torch.as_tensor(experts)
        ids = torch.stack([experts[torch.randperm(len(experts), generator=g)[:K]] for _ in range(T)])
        weights = torch.rand(T, K, generator=g)
        return x, ids.reshape(T, K), weights
    return make


@pytest.fixture(scope="session")
def dequantized_layer():
    """Stacked gate, up [E, I, H] and down [E, H, I] as the kernels hold them."""
    def stack(experts):
        parts = [experts.dequantized(e) for e in range(experts.num_experts)]
        return tuple(torch.stack(p) for p in zip(*parts))
    return stack
