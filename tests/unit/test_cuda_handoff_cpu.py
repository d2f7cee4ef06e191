"""The CUDA handoff's native half on a machine without a GPU: its host functions, called in order
by CudaHandoff.run, compute what CpuExperts.forward does on the staged rows; bad ids are caught
there; and asking for the handoff without CUDA is a clear error.

T tokens, K experts per token, E experts, H hidden, I expert intermediate size.
"""

import hybridmoe._native as native
import pytest
import torch

from hybridmoe import CpuExperts
from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.cuda_handoff import CudaHandoff

E, H, I, K, TMAX = 8, 64, 32, 2, 4


def experts(seed: int, fmt: str = "bf16") -> CpuExperts:
    g = torch.Generator().manual_seed(seed)
    return CpuExperts(torch.randn(E, I, H, generator=g) / H**0.5, torch.randn(E, I, H, generator=g) / H**0.5,
                      torch.randn(E, H, I, generator=g) / I**0.5, format=fmt, group_size=32, threads=2)


def staging(dtype):
    """x, ids, weights, out: one layer's staging buffers [TMAX, *] (plain host memory here)."""
    return (torch.zeros(TMAX, H, dtype=dtype), torch.zeros(TMAX, K, dtype=torch.int64),
            torch.zeros(TMAX, K), torch.zeros(TMAX, H, dtype=dtype))


def add_layer(handoff, ex: CpuExperts, bufs) -> int:
    st = ex.packed_state()
    return handoff.add_layer(E, H, I, st["format"], st["group_size"], st["zero_points"], ex.threads, ex.isa,
                             st["numa_nodes"], st["buffers"], *bufs)


def fill(bufs, T: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, ids, w, _ = bufs
    x[:T] = torch.randn(T, H, generator=g).to(x.dtype)
    ids[:T] = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w[:T] = torch.rand(T, K, generator=g)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_host_functions_equal_cpu_experts_forward(fmt, dtype):
    layers = [experts(0, fmt), experts(1, fmt)]
    handoff = native.CudaHandoff(TMAX, K)
    bufs = [staging(dtype) for _ in layers]
    idx = [add_layer(handoff, ex, b) for ex, b in zip(layers, bufs)]
    for T in (1, 3):
        for i, b in enumerate(bufs):
            fill(b, T, seed=10 * T + i)
        handoff.run(idx, T)
        for ex, (x, ids, w, out) in zip(layers, bufs):
            assert torch.equal(out[:T], ex.forward(x[:T].clone(), ids[:T].clone(), w[:T].clone()))
    assert handoff.take_error() is None


def test_out_of_range_id_zeroes_the_layer_and_is_reported_once():
    ex = experts(0)
    handoff = native.CudaHandoff(TMAX, K)
    bufs = staging(torch.bfloat16)
    layer = add_layer(handoff, ex, bufs)
    fill(bufs, 2, seed=0)
    bufs[3].fill_(1.0)
    bufs[1][1, 1] = E  # one past the last expert
    handoff.run([layer], 2)
    assert not bufs[3][:2].any()
    err = handoff.take_error()
    assert "topk_ids[1, 1] = 8 is out of range for 8 experts" in err
    assert handoff.take_error() is None
    bufs[1][1, 1] = (bufs[1][1, 0] + 1) % E
    handoff.run([layer], 2)
    assert bufs[3][:2].any() and handoff.take_error() is None


@pytest.mark.parametrize("which, bad, match", [
    (0, torch.zeros(TMAX, H + 1, dtype=torch.bfloat16), r"hidden staging must have shape \[4, 64\]"),
    (1, torch.zeros(TMAX, K, dtype=torch.int16), "topk_ids staging must be int32 or int64"),
    (2, torch.zeros(TMAX, K, dtype=torch.float64), "topk_weights staging must be float32"),
    (3, torch.zeros(TMAX, H, dtype=torch.float32), "output staging must have the hidden staging's dtype"),
    (3, torch.zeros(H, TMAX, dtype=torch.bfloat16).t(), "output staging must be contiguous"),
])
def test_bad_staging_buffers_are_rejected(which, bad, match):
    bufs = list(staging(torch.bfloat16))
    bufs[which] = bad
    with pytest.raises(ValueError, match=match):
        add_layer(native.CudaHandoff(TMAX, K), experts(0), bufs)


def test_missing_packed_buffer_is_rejected():
    ex = experts(0, "int4")
    st = ex.packed_state()
    st["buffers"].pop(next(iter(st["buffers"])))
    with pytest.raises(ValueError, match="is missing"):
        native.CudaHandoff(TMAX, K).add_layer(E, H, I, st["format"], st["group_size"], st["zero_points"],
                                              ex.threads, ex.isa, st["numa_nodes"], st["buffers"],
                                              *staging(torch.bfloat16))


def test_token_count_beyond_max_tokens_is_rejected():
    handoff = native.CudaHandoff(TMAX, K)
    layer = add_layer(handoff, experts(0), staging(torch.bfloat16))
    with pytest.raises(ValueError, match=r"T must be between 1 and max_tokens \(4\), got 5"):
        handoff.run([layer], TMAX + 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_handoff_without_cuda_is_a_clear_error():
    with pytest.raises(HybridMoEError, match="needs a CUDA GPU"):
        CudaHandoff([experts(0)], max_tokens=TMAX, top_k=K)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_enqueue_without_a_gpu_raises_instead_of_crashing():
    handoff = native.CudaHandoff(TMAX, K)
    layer = add_layer(handoff, experts(0), staging(torch.bfloat16))
    # Either no libcudart was loaded here, or it was and finds no driver/GPU: an error either way.
    with pytest.raises(RuntimeError, match="(?i)cuda"):
        handoff.enqueue_forward(0, layer, 1)
