"""The fixed-shape (decode) glue of a hybrid MoE layer, around its experts, in as few kernels as it takes.

Between the router and the experts, split_slots says which of each token's K slots run on the GPU
(mask, local ids) and lays the CPU's out as the dense [T, width] the CUDA handoff copies
(fixed_cpu_slots); route_split does the router's softmax top-k first, from its logits; after
them, sum_parts adds the two partial outputs (add_parts: and adds them to the residual, where deferred
experts join it). In torch that is ~20 small kernels and 3; on CUDA
with triton (fused) one each (decode_fused_triton.py). In a decode
step every kernel costs its launch and drain even inside a CUDA graph, and the GPU part of a
layer is serial with its CPU part, so they add up per layer. The torch versions here are the
reference the kernels are tested against, and what runs elsewhere.

T tokens, K experts per token, E experts of the layer, H hidden.
"""

from __future__ import annotations

import torch

from hybridmoe.layers.router import softmax_topk
from hybridmoe.platform import HAVE_TRITON


def _triton(t: torch.Tensor, fused: bool) -> bool:
    return fused and HAVE_TRITON and t.is_cuda


def fixed_cpu_slots(ids: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor, width: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept slots of each token as a dense [T, width] in fixed shapes (no host sync).

    ids [T, K] local to the CPU engine where keep; width >= the most any token keeps. Kept slots
    come first; the rest repeat the token's first kept expert (else the batch's first kept one,
    else 0) with weight 0, so padding reads no expert weights the step does not read anyway.
    The native engine computes a repeated expert once per slot (only its Python entry point
    insists on distinct ids).
    """
    order = torch.sort((~keep).to(torch.int32), dim=1, stable=True).indices[:, :width]  # kept slots first
    cids, cw, valid = ids.gather(1, order), weights.float().gather(1, order), keep.gather(1, order)
    first, has = cids[:, 0], valid[:, 0]  # [T]
    batch_first = torch.where(has.any(), first.gather(0, has.to(torch.int32).argmax().view(1)), 0)  # [1]
    pad = torch.where(has, first, batch_first)
    return torch.where(valid, cids, pad.unsqueeze(1)), torch.where(valid, cw, 0.0)


def split_slots(ids: torch.Tensor, weights: torch.Tensor, on_gpu: torch.Tensor, local: torch.Tensor,
                width: int, fused: bool = True, part: tuple[int, int] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Each token's slots split by where their experts live: (gpu_ids, gpu_mask, cpu_ids, cpu_weights).

    ids [T, K] global expert ids, weights [T, K]; on_gpu [E] bool; local [E] an expert's index among
    its side's experts. gpu_mask [T, K] bool: the slot's expert is on the GPU; gpu_ids [T, K] its
    local id there (anything where gpu_mask is False). cpu_ids [T, width] int64, cpu_weights
    [T, width] float32: fixed_cpu_slots of the others; both None when width is 0. part (lo, hi):
    only the columns lo <= k < hi are split, the others are neither GPU slots nor CPU slots (the
    deferred experts' part of a step, experts/deferral.py); None: every column.
    """
    if _triton(ids, fused):
        from hybridmoe.experts.decode_fused_triton import triton_split_slots

        return triton_split_slots(ids, weights, on_gpu, local, width, part)
    mask, lid = on_gpu[ids], local[ids]
    keep = ~mask
    if part is not None:
        col = torch.arange(ids.shape[1], device=ids.device)
        inside = (col >= part[0]) & (col < part[1])  # [K]
        mask, keep = mask & inside, keep & inside
    if width == 0:
        return lid, mask, None, None
    return (lid, mask, *fixed_cpu_slots(lid, weights, keep, width))


def route_split(router_logits: torch.Tensor, top_k: int, renormalize: bool, on_gpu: torch.Tensor,
                local: torch.Tensor, width: int, fused: bool = True, deferred: int = 0, stage=None, signal=None,
                later=None):
    """The router's softmax top-k (layers/router.py softmax_topk) and split_slots of its result, one kernel
    on CUDA (fused): (weights [T, K] float32, ids [T, K] int64, split_slots' four outputs).

    With deferred > 0 (expert deferral, experts/deferral.py: the top-k comes out largest weight first,
    so each token's deferred slots are its last `deferred` columns) the split is of the first
    K - deferred columns (part (0, K - deferred)); split_slots(..., part=(K - deferred, K)) splits the
    others when they are due.

    stage (x [T, H], x_dst [T, H], ids_dst [T, width], w_dst [T, width]): the step's rows for the CPU go
    straight to the CUDA handoff's staging buffers: the CPU slots are written to ids_dst, w_dst (returned as
    cpu_ids, cpu_weights) and x to x_dst (in x_dst's dtype), in the same kernel. signal (done, go: the
    handoff's mapped flag words, int32 [1]; with stage, on CUDA with triton only): the kernel also clears
    done and then writes go = T, which hands the rows to the CPU (CudaHandoff.kernel_flags); (done, go, value):
    go = value instead (CudaHandoff.merged_go | T, for linked handoffs).

    later (width2, ids_dst2, w_dst2, done2; with stage and deferred > 0): the deferred columns are split here too,
    their CPU slots written to ids_dst2, w_dst2 [T, width2] (the deferred part's staging), and with signal done2
    is cleared before go (the linked handoffs of CudaHandoff.link_deferred, which the one go starts): a fourth
    result, that split (split_slots' four outputs, cpu_ids and cpu_weights being ids_dst2, w_dst2)."""
    if stage is not None and not width:
        raise ValueError("route_split: stage needs CPU slots (width > 0)")
    if later is not None and (stage is None or not deferred or not later[0]):
        raise ValueError("route_split: later needs stage, deferred experts and CPU slots for them (width2 > 0)")
    if _triton(router_logits, fused):
        from hybridmoe.experts.decode_fused_triton import triton_route_split

        return triton_route_split(router_logits, top_k, renormalize, on_gpu, local, width, deferred, stage, signal,
                                  later)
    if signal is not None:
        raise ValueError("route_split: signal needs the Triton kernel (CUDA, triton, fused)")

    weights, ids = softmax_topk(router_logits, top_k, renormalize, fused=False)
    part = (0, top_k - deferred) if deferred else None
    gpu_ids, gpu_mask, cpu_ids, cpu_w = split_slots(ids, weights, on_gpu, local, width, fused=False, part=part)
    if stage is not None:
        x, x_dst, ids_dst, w_dst = stage
        x_dst.copy_(x)
        ids_dst.copy_(cpu_ids)
        w_dst.copy_(cpu_w)
        cpu_ids, cpu_w = ids_dst, w_dst
    if later is None:
        return weights, ids, (gpu_ids, gpu_mask, cpu_ids, cpu_w)
    width2, ids_dst2, w_dst2, _ = later
    gpu_ids2, gpu_mask2, cpu_ids2, cpu_w2 = split_slots(ids, weights, on_gpu, local, width2, fused=False,
                                                        part=(top_k - deferred, top_k))
    ids_dst2.copy_(cpu_ids2)
    w_dst2.copy_(cpu_w2)
    return weights, ids, (gpu_ids, gpu_mask, cpu_ids, cpu_w), (gpu_ids2, gpu_mask2, ids_dst2, w_dst2)


def sum_parts(parts: list[torch.Tensor], dtype: torch.dtype, fused: bool = True, done: torch.Tensor | None = None
              ) -> torch.Tensor:
    """The sum of 2 to 4 partial outputs in float32, in list order, rounded once to dtype; parts [T, H] on one
    device, any float dtypes. done (the CUDA handoff's mapped done word, int32 [1]; on CUDA with triton only):
    the kernel first waits for it to read 1 (part 0 is that handoff's output), and one part is allowed."""
    if _triton(parts[0], fused):
        from hybridmoe.experts.decode_fused_triton import triton_sum_parts

        return triton_sum_parts(parts, dtype, done)
    if done is not None:
        raise ValueError("sum_parts: done needs the Triton kernel (CUDA, triton, fused)")
    total = parts[0].float() + parts[1].float()
    for p in parts[2:]:
        total = total + p.float()
    return total.to(dtype)


def add_parts(hidden: torch.Tensor, parts: list[torch.Tensor], fused: bool = True, done: torch.Tensor | None = None
              ) -> torch.Tensor:
    """hidden + the sum of one or two partial outputs (sum_parts' rounding), as torch adds them:
    hidden + (a + b in float32, rounded to hidden's dtype), rounded once more. hidden [T, H]; parts
    [T, H] of any float dtypes, on hidden's device. One kernel on CUDA (fused) instead of two. done: as
    sum_parts' (the kernel first waits for the CUDA handoff's done word of part 0)."""
    if _triton(hidden, fused):
        from hybridmoe.experts.decode_fused_triton import triton_add_parts

        return triton_add_parts(hidden, parts, done)
    if done is not None:
        raise ValueError("add_parts: done needs the Triton kernel (CUDA, triton, fused)")
    if len(parts) == 1:
        return hidden + parts[0].to(hidden.dtype)
    return hidden + sum_parts(parts, hidden.dtype, fused=False)
