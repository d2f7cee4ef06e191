"""A prefill chunk's attention with no window (layers/attention.py _sdpa_causal: the lower-right causal
bias, key/value heads repeated) equals the explicit causal mask of the general path, for a chunk that
starts the sequence and one that continues it, with grouped query heads."""

import pytest
import torch

from hybridmoe.layers.attention import _sdpa, _sdpa_causal, _visible


@pytest.mark.parametrize("n, m", [(7, 7), (5, 12)])
def test_the_causal_bias_equals_the_mask(n, m):
    g = torch.Generator().manual_seed(n * m)
    q, k, v = torch.randn(n, 8, 16, generator=g), torch.randn(m, 2, 16, generator=g), torch.randn(m, 2, 16, generator=g)
    mask = _visible(torch.arange(m - n, m), torch.arange(m), None)  # the queries are the last n positions
    torch.testing.assert_close(_sdpa_causal(q, k, v, 0.25), _sdpa(q, k, v, mask, 0.25), atol=1e-6, rtol=1e-6)
