"""gpt-oss's expert activation: a SwiGLU with both inputs clamped and a sigmoid gain.

An expert computes h = glu(gate x + b_gate, up x + b_up), then down h + b_down. With limit L and gain alpha:
gate is clamped to at most L, up to [-L, L]; glu = gate * sigmoid(alpha * gate) and h = (up + 1) * glu.
Plain experts compute act(gate x) * up x instead (layers/mlp.py ACTIVATIONS). A model whose experts need this
declares it in its config (`expert_glu`), and the expert backend applies it in place of act(gate) * up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class ClampedSwiGLU:
    name: ClassVar[str] = "clamped SwiGLU"
    """What messages call it."""

    alpha: float
    """The sigmoid's gain (transformers' GptOssConfig swiglu_alpha, 1.702)."""

    limit: float
    """The clamp (swiglu_limit, 7.0): gate at most limit, up within [-limit, limit]."""

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate, up [T, I] (the projections with their biases) -> [T, I]."""
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
