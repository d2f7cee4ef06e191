"""softmax_topk (layers/router.py) as one Triton kernel: router logits -> top-k weights and ids.

torch runs it as ~5 kernels (cast, softmax, topk, sum, divide); in a decode step each costs its
launch and drain even inside a CUDA graph. One program per token: softmax over its E logits in
float32, then K rounds of "take the largest, lowest id first among equals", then the optional
renormalization. The ids come out largest weight first, as torch.topk's.

T tokens, E experts, K experts per token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softmax_topk_kernel(logits_ptr, w_ptr, ids_ptr, E, stride_l,
                         K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * stride_l + cols, mask=cols < E, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    left = tl.where(cols < E, p, -1.0)  # probabilities not yet taken; -1 below any
    ks = tl.arange(0, BLOCK_K)
    top_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for k in tl.static_range(K):
        best = tl.max(left, axis=0)
        idx = tl.min(tl.where(left == best, cols, BLOCK_E), axis=0)
        top_w = tl.where(ks == k, best, top_w)
        top_i = tl.where(ks == k, idx.to(tl.int64), top_i)
        left = tl.where(cols == idx, -1.0, left)
    if RENORMALIZE:
        top_w = top_w / tl.sum(tl.where(ks < K, top_w, 0.0), axis=0)
    tl.store(w_ptr + t * K + ks, top_w, mask=ks < K)
    tl.store(ids_ptr + t * K + ks, top_i, mask=ks < K)


def triton_softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, K] float32, ids [T, K] int64), as softmax_topk."""
    T, E = router_logits.shape
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    _softmax_topk_kernel[(T,)](logits, weights, ids, E, logits.stride(0), K=top_k, RENORMALIZE=renormalize,
                               BLOCK_E=triton.next_power_of_2(E), BLOCK_K=max(2, triton.next_power_of_2(top_k)))
    return weights, ids
