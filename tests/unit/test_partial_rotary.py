"""Partial rotary (layers/rotary.py apply_rotary with cos/sin narrower than the head, GLM-4.5's
partial_rotary_factor): the first R dimensions of each head turn exactly as full rotary of an R-dimension head
would, the other D - R pass through untouched, as transformers' Glm4Moe attention does."""

import pytest
import torch
from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb

from hybridmoe.layers.rotary import RotaryEmbedding, apply_rotary

T, HEADS, D = 7, 3, 32
ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def inputs(rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, HEADS, D] and the cos, sin [T, rotary_dim] of positions 0, 3, 6, ..."""
    x = torch.randn(T, HEADS, D, generator=torch.Generator().manual_seed(0))
    cos, sin = RotaryEmbedding(rotary_dim, ROPE)(torch.arange(T) * 3, torch.float32)
    return x, cos, sin


@pytest.mark.parametrize("rotary_dim", [2, 8, 16, 24])
def test_the_first_dims_rotate_as_a_head_of_that_width_and_the_rest_pass_through(rotary_dim):
    x, cos, sin = inputs(rotary_dim)
    out = apply_rotary(x, cos, sin)
    assert out.shape == x.shape
    torch.testing.assert_close(out[..., :rotary_dim], apply_rotary(x[..., :rotary_dim].contiguous(), cos, sin),
                               rtol=0, atol=0)
    assert torch.equal(out[..., rotary_dim:], x[..., rotary_dim:])


def test_each_pair_of_the_rotated_dims_turns_by_its_own_angle():
    """Dimensions i and i + R/2 form the pair that turns by position * inv_freq[i] (neox layout)."""
    rotary_dim, half = 8, 4
    x, cos, sin = inputs(rotary_dim)
    out = apply_rotary(x, cos, sin)
    angle = (torch.arange(T) * 3).float()[:, None] * RotaryEmbedding(rotary_dim, ROPE).inv_freq(torch.device("cpu"))
    c, s = angle.cos()[:, None, :], angle.sin()[:, None, :]  # [T, 1, R/2]
    a, b = x[..., :half], x[..., half:rotary_dim]
    torch.testing.assert_close(out[..., :half], a * c - b * s)
    torch.testing.assert_close(out[..., half:rotary_dim], b * c + a * s)


@pytest.mark.parametrize("rotary_dim", [8, 16, D])
def test_equals_transformers_glm4_moe(rotary_dim):
    x, cos, sin = inputs(rotary_dim)
    k = x.flip(0)
    # transformers: q, k [B, heads, T, D], cos, sin [B, T, R]
    theirs_q, theirs_k = apply_rotary_pos_emb(x.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    torch.testing.assert_close(apply_rotary(x, cos, sin), theirs_q[0].transpose(0, 1))
    torch.testing.assert_close(apply_rotary(k, cos, sin), theirs_k[0].transpose(0, 1))


def test_the_frequencies_are_those_of_the_rotated_width():
    """A head of D with R rotating uses base ** (-2i / R), not base ** (-2i / D)."""
    inv_freq = RotaryEmbedding(8, ROPE).inv_freq(torch.device("cpu"))
    torch.testing.assert_close(inv_freq, 10000.0 ** (-torch.arange(0, 8, 2).float() / 8))
