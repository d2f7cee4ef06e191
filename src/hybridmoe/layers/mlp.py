"""The gated MLP of dense layers and shared experts: down(act(gate x) * up x)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridmoe.errors import HybridMoEError
from hybridmoe.layers.linear import MergedLinear

ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu}


def get_activation(name: str):
    if name not in ACTIVATIONS:
        raise HybridMoEError(f"unsupported hidden_act {name!r}; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """Checkpoint tensors gate_proj and up_proj load into gate_up_proj (shards 0, 1)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu"):
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size])
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = get_activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.split(self.gate_up_proj(x))
        return self.down_proj(self.act(gate) * up)
