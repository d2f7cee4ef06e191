"""Weights brought into the GPU's L2 cache ahead of their use, by one kernel of prefetch instructions.

In a hybrid decode step the GPU waits for each MoE layer's CPU experts (100-450 µs on Qwen3-30B-A3B), then
runs the next layer's attention, whose GEMVs read their weights from HBM (qkv_proj 21 MB, o_proj 17 MB at
2.2-2.6 TB/s in a decode GEMV: 8 and 7 µs, serial with the CPU). Enqueued before the wait, this kernel
issues one L2 prefetch (evict_last) per 128-byte line of those weights and ends; the lines arrive while the
GPU would idle, and the GEMVs after the wait read them from L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LINE = 128  # bytes per prefetch: an L2 line
BLOCK = 1024  # lines per program


@triton.jit
def _prefetch_kernel(p0, n0, p1, n1, p2, n2, BLOCK: tl.constexpr, LINE: tl.constexpr):
    """Program (b, i): lines b*BLOCK .. (b+1)*BLOCK - 1 of region i (base p_i, n_i lines), those that exist."""
    i = tl.program_id(1)
    line = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if i == 0:
        ptr, ok = p0 + tl.minimum(line, n0 - 1).to(tl.int64) * LINE, line < n0
    elif i == 1:
        ptr, ok = p1 + tl.minimum(line, n1 - 1).to(tl.int64) * LINE, line < n1
    else:
        ptr, ok = p2 + tl.minimum(line, n2 - 1).to(tl.int64) * LINE, line < n2
    tl.inline_asm_elementwise(
        asm="""{
        .reg .pred ok;
        setp.ne.u32 ok, $2, 0;
        @ok prefetch.global.L2::evict_last [$1];
        mov.u32 $0, 0;
        }""",
        constraints="=r,l,r", args=[ptr, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_l2(tensors: list[torch.Tensor]) -> None:
    """Prefetch the bytes of one to three contiguous CUDA tensors into L2 (one kernel on the current stream;
    nothing waits for the lines)."""
    if not 1 <= len(tensors) <= 3:
        raise ValueError(f"prefetch_l2 takes one to three tensors, got {len(tensors)}")
    regions = []
    for t in tensors:
        if not (t.is_cuda and t.is_contiguous()):
            raise ValueError("prefetch_l2 takes contiguous CUDA tensors")
        regions.append((t.reshape(-1).view(torch.uint8), triton.cdiv(t.numel() * t.element_size(), LINE)))
    regions += [regions[0]] * (3 - len(regions))
    grid = (triton.cdiv(max(n for _, n in regions), BLOCK), 3)
    _prefetch_kernel[grid](regions[0][0], regions[0][1], regions[1][0], regions[1][1], regions[2][0], regions[2][1],
                           BLOCK=BLOCK, LINE=LINE)
