"""Where routed experts run is decided here, not in the model.

A model's MoE block computes the router's top-k and hands (hidden, ids, weights) to an
ExpertBackend; it never sees expert weights. Backends: the torch reference (any device,
the ground truth in tests), the native CPU engine, and later the GPU cache and the hybrid.

Shapes: T tokens, H hidden, K experts per token, E experts, I expert intermediate size.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class ExpertBackend(ABC):
    """Routed experts of every MoE layer of one model."""

    @abstractmethod
    def set_layer(self, layer: int, gate_proj: torch.Tensor, up_proj: torch.Tensor,
                  down_proj: torch.Tensor) -> None:
        """Take the stacked expert weights of one layer: gate/up [E, I, H], down [E, H, I]."""

    @abstractmethod
    def submit(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
               topk_weights: torch.Tensor) -> None:
        """Start sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t]) for layer.

        hidden [T, H], topk_ids [T, K] int, topk_weights [T, K] float32.
        """

    @abstractmethod
    def wait(self, layer: int) -> torch.Tensor:
        """The result of the last submit for layer: [T, H], hidden's dtype and device."""

    @abstractmethod
    def layers(self) -> list[int]:
        """Indices of the layers whose weights have been set."""

    def after_layer(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """The residual stream after decoder layer `layer`: what a backend that defers expert output
        (experts/deferral.py) adds there. hidden [T, H]; returned as is when nothing is due."""
        return hidden

    def forward_logits(self, layer: int, hidden: torch.Tensor, router_logits: torch.Tensor, top_k: int,
                       renormalize: bool, residual: torch.Tensor | None = None) -> torch.Tensor | None:
        """forward() of the router's softmax top-k of router_logits [T, E], for a backend that routes a
        step itself (fusing the top-k into what it does next); None: it does not, the caller routes.
        residual [T, H]: return residual + forward() (rounded as torch adds them) instead."""
        return None

    def forward(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        self.submit(layer, hidden, topk_ids, topk_weights)
        return self.wait(layer)
