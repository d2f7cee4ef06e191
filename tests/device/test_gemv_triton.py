"""The decode GEMV (layers/gemv_triton.py) on CUDA against the torch ops it replaces: F.linear alone, and
RMSNorm (with and without its residual add) then F.linear, over batch sizes, odd shapes (N not a multiple
of the block, K not a power of two), a bias, and float32 / bfloat16. Runs on the GPU host.

T tokens, K input features, N output features.
"""

import pytest
import torch
import torch.nn.functional as F

from hybridmoe.layers.norm import RMSNorm

pytestmark = [pytest.mark.device,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def reference(x, w, b, nw, eps, res):
    """(y, normed, total) as the model's torch ops compute them."""
    if nw is None:
        return F.linear(x, w, b), None, None
    norm = RMSNorm(x.shape[1], eps).to(x.device)
    norm.weight.data = nw
    norm.fused = False
    normed, total = norm(x, residual=res) if res is not None else (norm(x), None)
    return F.linear(normed, w, b), normed, total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("before", ["", "norm", "add+norm"])
@pytest.mark.parametrize("T,N,K,bias", [(1, 5120, 2048, False), (4, 2048, 4096, False), (3, 128, 2048, False),
                                        (2, 37, 1000, True), (1, 3, 96, True)])
def test_gemv_with_norm_equals_norm_then_linear(T, N, K, bias, before, dtype):
    from hybridmoe.layers.gemv_triton import triton_norm_gemv

    g = torch.Generator().manual_seed(N + K + T)
    x, res = (torch.randn(T, K, generator=g).to("cuda", dtype) for _ in range(2))
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to("cuda", dtype)
    b = torch.randn(N, generator=g).to("cuda", dtype) if bias else None
    nw = (1 + 0.1 * torch.randn(K, generator=g)).to("cuda", dtype) if before else None
    r = res if before == "add+norm" else None
    y, normed, total = triton_norm_gemv(x, w, b, nw, 1e-6, r)
    want_y, want_normed, want_total = reference(x, w, b, nw, 1e-6, r)
    torch.testing.assert_close(y, want_y, **TOL[dtype])
    if before:
        torch.testing.assert_close(normed, want_normed, **TOL[dtype])
    else:
        assert normed is None
    if r is not None:
        assert torch.equal(total, want_total)  # one float32 add, rounded once, either way
    else:
        assert total is None


def test_gemv_reads_rows_with_a_stride():
    from hybridmoe.layers.gemv_triton import triton_norm_gemv

    g = torch.Generator().manual_seed(0)
    wide = torch.randn(3, 600, generator=g).to("cuda", torch.float32)
    x = wide[:, :512]  # row stride 600
    w = torch.randn(64, 512, generator=g).to("cuda", torch.float32)
    torch.testing.assert_close(triton_norm_gemv(x, w)[0], F.linear(x, w), **TOL[torch.float32])
