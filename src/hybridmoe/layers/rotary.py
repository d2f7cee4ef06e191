"""Rotary position embeddings (neox layout: the two halves of the rotated dimensions rotate together).

Partial rotary (GLM-4.5's partial_rotary_factor): only a head's first R of D dimensions rotate, R being
the RotaryEmbedding's dim; the other D - R pass through unchanged.

`rope_parameters` is the normalized dict of config.json ({"rope_type", "rope_theta", ...});
ROPE_INIT maps a rope_type to a function returning (inv_freq [D/2] float32, attention
scaling applied to cos/sin). Other rope types (e.g. YaRN) register themselves here.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from hybridmoe.errors import HybridMoEError


def default_inv_freq(params: dict, dim: int) -> tuple[torch.Tensor, float]:
    base = float(params["rope_theta"])
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0


def linear_inv_freq(params: dict, dim: int) -> tuple[torch.Tensor, float]:
    # Linear scaling divides positions by factor, the same as dividing every frequency by it.
    inv_freq, scale = default_inv_freq(params, dim)
    return inv_freq / float(params["factor"]), scale


ROPE_INIT: dict[str, Callable[[dict, int], tuple[torch.Tensor, float]]] = {
    "default": default_inv_freq,
    "linear": linear_inv_freq,
}


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos, sin [T, R] (already in x's dtype), R <= D: the first R dimensions of each head
    rotate (their two halves together), the last D - R pass through."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)
    rot, rest = x[..., :r], x[..., r:]
    return torch.cat((rot * cos.unsqueeze(1) + rotate_half(rot) * sin.unsqueeze(1), rest), dim=-1)


class RotaryEmbedding(nn.Module):
    """Computes cos/sin [T, D] for the given positions; frequencies stay float32 whatever the model dtype.

    inv_freq is a plain attribute, not a buffer, so building the model on the meta device or
    casting it to bf16 never touches it.
    """

    def __init__(self, dim: int, rope_parameters: dict):
        super().__init__()
        rope_type = rope_parameters.get("rope_type", "default")
        if rope_type not in ROPE_INIT:
            raise HybridMoEError(
                f"unsupported rope_type {rope_type!r}; supported: {', '.join(sorted(ROPE_INIT))}")
        self.dim = dim
        with torch.device("cpu"):  # real numbers even while the model is built on the meta device
            self._inv_freq, self.attention_scaling = ROPE_INIT[rope_type](rope_parameters, dim)

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """[D / 2] float32 on device (copied there once)."""
        if self._inv_freq.device != device:
            self._inv_freq = self._inv_freq.to(device)
        return self._inv_freq

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)
