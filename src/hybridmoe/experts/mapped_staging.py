"""The CUDA handoff's staging buffers as the GPU sees them: pinned host memory mapped into the device's
address space (unified addressing: the same address), written and read by kernels over PCIe.

A copy between device and pinned memory is one copy-engine operation, with a latency of a few µs
each even for a few KB; a layer's handoff makes four (hidden, ids, weights out; the output back). Through
the mapping, one kernel writes the three inputs (copy_words) and the layer's consumer reads the output
where the CPU wrote it. Used by CudaHandoff(zero_copy=True).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


def device_view(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor over the memory of pinned, contiguous host tensor t (same shape and dtype)."""
    if not (t.is_pinned() and t.is_contiguous()) or t.numel() * t.element_size() % 4:
        raise ValueError("device_view needs a pinned, contiguous tensor of whole 32-bit words")

    class Words:  # the memory as int32 words, through the CUDA array interface
        __cuda_array_interface__ = {"shape": (t.numel() * t.element_size() // 4,), "typestr": "<i4",
                                    "data": (t.data_ptr(), False), "version": 3, "strides": None}

    words = torch.as_tensor(Words(), device=device)
    return words.view(t.dtype).view(t.shape)


@triton.jit
def _copy_words_kernel(src0, dst0, n0, src1, dst1, n1, src2, dst2, n2, BLOCK: tl.constexpr):
    """Program (b, p) copies block b of pair p's int32 words."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    p = tl.program_id(1)
    if p == 0:
        tl.store(dst0 + offs, tl.load(src0 + offs, mask=offs < n0), mask=offs < n0)
    elif p == 1:
        tl.store(dst1 + offs, tl.load(src1 + offs, mask=offs < n1), mask=offs < n1)
    else:
        tl.store(dst2 + offs, tl.load(src2 + offs, mask=offs < n2), mask=offs < n2)


def copy_words(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """dst.copy_(src), bit for bit, for one to three (src, dst) pairs of contiguous CUDA tensors of the
    same byte size (whole 32-bit words), in one kernel launch on the current stream."""
    if not 1 <= len(pairs) <= 3:
        raise ValueError(f"copy_words takes one to three pairs, got {len(pairs)}")
    words = []
    for src, dst in pairs:
        if src.numel() * src.element_size() != dst.numel() * dst.element_size():
            raise ValueError(f"copy_words: {list(src.shape)} {src.dtype} and {list(dst.shape)} {dst.dtype} "
                             "differ in size")
        words.append((src.reshape(-1).view(torch.int32), dst.reshape(-1).view(torch.int32)))
    words += [(words[0][0], words[0][1])] * (3 - len(words))
    sizes = [w[0].numel() for w in words[:len(pairs)]] + [0] * (3 - len(pairs))
    grid = (triton.cdiv(max(sizes), BLOCK), 3)
    _copy_words_kernel[grid](words[0][0], words[0][1], sizes[0], words[1][0], words[1][1], sizes[1],
                             words[2][0], words[2][1], sizes[2], BLOCK=BLOCK)
