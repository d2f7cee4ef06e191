"""Router helpers: from router logits to each token's top-k expert ids and weights.

The experts themselves are not here: a model's MoE block hands (hidden, ids, weights) to
an ExpertBackend. T tokens, E experts, K experts per token.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridmoe.experts.base import ExpertBackend
from hybridmoe.experts.gpu_experts import HAVE_TRITON


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                 fused: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all E experts in float32, keep the K largest, optionally rescale them to sum to 1.

    router_logits [T, E] -> (weights [T, K] float32, ids [T, K] int64). On CUDA with triton and
    fused, one kernel (router_triton.py); else these torch ops.
    """
    if fused and HAVE_TRITON and router_logits.is_cuda:
        from hybridmoe.layers.router_triton import triton_softmax_topk

        return triton_softmax_topk(router_logits, top_k, renormalize)
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class SparseMoeBlock(nn.Module):
    """Router gate + routed experts: softmax top-k over `gate`, experts run by the ExpertBackend.

    The block holds no expert weights; the loader hands them to the backend under layer_idx.
    """

    takes_router_logits = True
    """forward(x, logits) takes gate(x) made by the caller (DecoderLayer's norm + router GEMV)."""
    adds_residual = True
    """DecoderLayer hands it the residual stream: forward(x, logits, residual) returns residual + the block's
    output (the backend may add it in the kernel that sums its experts' parts: one kernel less per decode layer;
    measured with HybridExperts.kernel_flags on the GPU host, session 6 r2)."""

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
