"""Recording routing statistics: a pass-through ExpertBackend that counts each layer's routed tokens.

E routed experts per layer; T tokens, K experts per token.
"""

from __future__ import annotations

import torch

from hybridmoe.experts.base import ExpertBackend
from hybridmoe.experts.placement import ExpertStats


class RoutingCounter(ExpertBackend):
    """Wraps the backend a model runs with; counts[layer][e] += tokens routed to expert e."""

    def __init__(self, inner: ExpertBackend, num_experts: int, moe_layers: list[int]):
        self.inner, self.num_experts = inner, num_experts
        self.counts = {layer: torch.zeros(num_experts, dtype=torch.long) for layer in moe_layers}
        self.tokens = 0
        self._first = min(moe_layers) if moe_layers else None

    @classmethod
    def install(cls, model) -> "RoutingCounter":
        """Put a counter between model and its backend (every module that holds the backend)."""
        inner = model.experts
        counter = cls(inner, model.expert_dims()[0], model.moe_layers)
        for module in model.modules():
            if getattr(module, "experts", None) is inner:
                module.experts = counter
        return counter

    def uninstall(self, model) -> None:
        """Put the wrapped backend back wherever install put this counter."""
        for module in model.modules():
            if getattr(module, "experts", None) is self:
                module.experts = self.inner

    def reset(self) -> None:
        """Count again from zero (e.g. after the prompt, to count decode steps only)."""
        for counts in self.counts.values():
            counts.zero_()
        self.tokens = 0

    def stats(self) -> ExpertStats:
        return ExpertStats({layer: c.tolist() for layer, c in self.counts.items()}, self.tokens)

    def set_layer(self, layer, gate_proj, up_proj, down_proj):
        self.inner.set_layer(layer, gate_proj, up_proj, down_proj)

    def layers(self):
        return self.inner.layers()

    def submit(self, layer, hidden, topk_ids, topk_weights):
        self.counts[layer] += torch.bincount(topk_ids.flatten().cpu(), minlength=self.num_experts)
        if layer == self._first:
            self.tokens += topk_ids.shape[0]
        self.inner.submit(layer, hidden, topk_ids, topk_weights)

    def wait(self, layer):
        return self.inner.wait(layer)

    def after_layer(self, layer, hidden):
        return self.inner.after_layer(layer, hidden)
