"""The sparse MoE block of Qwen2/3-MoE and Mixtral: the router gate and its top-k, with the routed experts
run by an ExpertBackend (experts/base.py) that the block is handed: the block never sees expert weights.

T tokens, H hidden, E experts, K experts per token.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridmoe.experts.base import ExpertBackend
from hybridmoe.layers.router import softmax_topk


class SparseMoeBlock(nn.Module):
    """Router gate + routed experts: softmax top-k over `gate`, experts run by the ExpertBackend.

    The block holds no expert weights; the loader hands them to the backend under layer_idx.
    """

    takes_router_logits = True
    """forward(x, logits) takes gate(x) made by the caller (DecoderLayer's norm + router GEMV)."""
    adds_residual = True
    """DecoderLayer hands it the residual stream: forward(x, logits, residual) returns residual + the block's
    output (the backend may add it in the kernel that sums its experts' parts: one kernel less per decode layer)."""

    def __init__(self, layer_idx: int, hidden_size: int, num_experts: int, top_k: int, renormalize: bool,
                 experts: ExpertBackend):
        super().__init__()
        self.layer_idx, self.top_k, self.renormalize = layer_idx, top_k, renormalize
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = experts
        self.fused = True  # the router in one kernel on CUDA (softmax_topk)

    def forward(self, x: torch.Tensor, logits: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H] (residual + that, if residual [T, H] is given). logits: gate(x) [T, E] if the
        caller made it (DecoderLayer, with the norm before it in one kernel)."""
        if logits is None:
            logits = self.gate(x)
        if self.fused:  # the backend may fuse the top-k into its split of the step (HybridExperts)
            out = self.experts.forward_logits(self.layer_idx, x, logits, self.top_k, self.renormalize, residual)
            if out is not None:
                return out
        weights, ids = softmax_topk(logits, self.top_k, self.renormalize, self.fused)
        out = self.experts.forward(self.layer_idx, x, ids, weights)
        return out if residual is None else residual + out
