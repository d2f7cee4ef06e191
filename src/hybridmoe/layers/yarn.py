"""Rotary frequencies for DeepSeek's MLA: plain RoPE or YaRN, with DeepSeek's two mscales.

YaRN (arXiv 2309.00071) keeps high-frequency dimensions as trained (extrapolation), divides
low-frequency ones by `factor` (interpolation), and ramps linearly between the dimensions
that make beta_fast and beta_slow rotations over the original context.

DeepSeek scales attention in two places, and transformers follows it:
- cos/sin are multiplied by attention_factor = mscale(factor, mscale) / mscale(factor,
  mscale_all_dim) (1.0 in the released checkpoints, where both are equal);
- the softmax scale qk_head_dim**-0.5 is multiplied by mscale(factor, mscale_all_dim)**2,
  because the nope half of q.k never sees the rotary factor.

`rope` below is the normalized rope dict (models/base.py normalize_rope, then complete_yarn).
"""

from __future__ import annotations

import math

import torch

from hybridmoe.layers.rotary import ROPE_INIT


def complete_yarn(rope: dict, max_position_embeddings: int) -> dict:
    """Fill what a yarn rope dict may leave out, as transformers does: the original context
    defaults to max_position_embeddings, and factor to the ratio of the two."""
    if rope.get("rope_type") != "yarn":
        return rope
    rope = dict(rope)
    if rope.get("original_max_position_embeddings") is None:
        rope["original_max_position_embeddings"] = max_position_embeddings
    if rope.get("factor") is None:
        rope["factor"] = max_position_embeddings / rope["original_max_position_embeddings"]
    return rope


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, base: float, factor: float, original_max_position_embeddings: int,
                  beta_fast: float = 32, beta_slow: float = 1, truncate: bool = True) -> torch.Tensor:
    """Inverse frequencies [dim // 2], blended between extrapolation and interpolation."""

    def correction_dim(num_rotations):
        return dim * math.log(original_max_position_embeddings / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-dimension ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def yarn_rope(rope: dict, dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim // 2], factor applied to cos and sin): the ROPE_INIT entry for "yarn"."""
    factor = rope["factor"]
    inv_freq = yarn_inv_freq(dim, rope["rope_theta"], factor, rope["original_max_position_embeddings"],
                             rope.get("beta_fast") or 32, rope.get("beta_slow") or 1, rope.get("truncate", True))
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        # transformers uses the ratio only when both are set (and nonzero), else plain YaRN
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
    return inv_freq, float(attention_factor)


def softmax_scale(rope: dict, qk_head_dim: int) -> float:
    """qk_head_dim**-0.5, times mscale(factor, mscale_all_dim)**2 under YaRN."""
    scale = qk_head_dim ** -0.5
    mscale_all_dim = rope.get("mscale_all_dim")
    if rope["rope_type"] != "default" and mscale_all_dim:
        mscale = yarn_get_mscale(rope["factor"], mscale_all_dim)
        scale = scale * mscale * mscale
    return scale


ROPE_INIT["yarn"] = yarn_rope
