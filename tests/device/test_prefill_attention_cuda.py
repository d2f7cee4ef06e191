"""Prefill attention on the GPU (layers/attention.py _sdpa_causal: the causal bias lets SDPA take its
flash kernels) against the explicit causal mask of the general path, in bf16 and float32, for a chunk
that starts its sequence and one that continues it, with grouped query heads."""

import pytest
import torch

from hybridmoe.layers.attention import _sdpa, _sdpa_causal, _visible

pytestmark = [pytest.mark.device,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, m", [(512, 512), (300, 2348)])
def test_the_causal_bias_equals_the_mask_on_cuda(dtype, n, m):
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(rows, heads, 128, generator=g).to("cuda", dtype)
               for rows, heads in ((n, 32), (m, 4), (m, 4)))
    mask = _visible(torch.arange(m - n, m, device="cuda"), torch.arange(m, device="cuda"), None)
    torch.testing.assert_close(_sdpa_causal(q, k, v, 128 ** -0.5), _sdpa(q, k, v, mask, 128 ** -0.5), **TOL[dtype])
