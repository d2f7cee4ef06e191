"""The torch reference for routed experts: plain, any device, the ground truth in tests."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from hybridmoe.experts.base import ExpertBackend


def ref_moe(hidden: torch.Tensor, gate_proj: torch.Tensor, up_proj: torch.Tensor,
            down_proj: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            act=F.silu) -> torch.Tensor:
    """sum_k w[t,k] * down_e(act(gate_e x) * up_e x), computed in float32.

    hidden [T, H]; gate_proj, up_proj [E, I, H]; down_proj [E, H, I]; topk_ids [T, K];
    topk_weights [T, K]. Returns [T, H] float32.
    """
    x = hidden.float()
    out = torch.zeros_like(x)
    ids = topk_ids.long()
    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        xe = x[tok]
        h = act(xe @ gate_proj[e].float().T) * (xe @ up_proj[e].float().T)
        ye = h @ down_proj[e].float().T
        out.index_add_(0, tok, ye * topk_weights[tok, slot].float().unsqueeze(1))
    return out


class TorchExperts(ExpertBackend):
    """Routed experts held as stacked tensors and computed with torch on their device.

    Computes in the weights' dtype (like transformers does), accumulating the weighted
    sum in float32. An expert is down(act(gate x) * up x), or, given glu (a model's expert_glu,
    layers/clamped_swiglu.py), down(glu(gate x, up x)); each projection adds its bias where the
    loader handed the layer's biases (set_layer_biases).
    """

    def __init__(self, act=F.silu, glu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None):
        self.act, self.glu = act, glu
        self._weights: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._biases: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._results: dict[int, torch.Tensor] = {}

    def set_layer(self, layer, gate_proj, up_proj, down_proj):
        self._weights[layer] = (gate_proj, up_proj, down_proj)

    def set_layer_biases(self, layer, gate_bias, up_bias, down_bias):
        self._biases[layer] = (gate_bias, up_bias, down_bias)

    def layers(self):
        return sorted(self._weights)

    def _gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.glu(gate, up) if self.glu is not None else self.act(gate) * up

    def submit(self, layer, hidden, topk_ids, topk_weights):
        gate, up, down = self._weights[layer]
        biases = self._biases.get(layer)
        x = hidden.to(gate.dtype)
        out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        ids = topk_ids.long()
        for e in torch.unique(ids).tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            xe = x[tok]
            gb, ub, db = (b[e] for b in biases) if biases is not None else (None, None, None)
            ye = F.linear(self._gated(F.linear(xe, gate[e], gb), F.linear(xe, up[e], ub)), down[e], db)
            out.index_add_(0, tok, ye.float() * topk_weights[tok, slot].float().unsqueeze(1))
        self._results[layer] = out.to(hidden.dtype)

    def wait(self, layer):
        return self._results.pop(layer)
