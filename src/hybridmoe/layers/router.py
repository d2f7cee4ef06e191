"""The router's top-k: from router logits to each token's top-k expert ids and weights.

The experts themselves are not here: a model's MoE block (models/moe_block.py) hands (hidden, ids, weights)
to an ExpertBackend. T tokens, E experts, K experts per token.
"""

from __future__ import annotations

import torch

from hybridmoe.platform import HAVE_TRITON


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


def topk_softmax(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K largest logits, then a softmax over those K only (gpt-oss), in float32.

    router_logits [T, E] -> (weights [T, K] float32, ids [T, K] int64). Mathematically softmax_topk with
    renormalize, but softmax over the K chosen logits rounds as transformers' GptOssTopKRouter does.
    """
    values, ids = torch.topk(router_logits.float(), top_k, dim=-1)
    return torch.softmax(values, dim=-1), ids
