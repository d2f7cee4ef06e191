"""The native engine's packed expert layouts (csrc/moe/packed.h) dequantized on the GPU by one Triton kernel.

PackedLayout.dequantize (experts/packed_torch.py) runs this on CUDA when triton is there: one pass
that reads each packed byte and writes each weight once, where the torch version makes several
passes (a transpose, nibble planes, float32 codes) of up to 14 bytes a weight, which made int4 the
costliest part of a streamed layer. The values are the torch version's bit for bit: the same
integer codes, (code - zero) * scale in float32, rounded once to the output dtype.

Layouts (packed_torch.py's docstring has the whole picture), per block of 32 rows of an expert:
  bf16 / int8: element (row, k) at ((k // 2) * 32 + row) * 2 + k % 2
  int4:        byte ((((k // 8) * 2 + row // 16) * 2 + (k % 4) // 2) * 16 + row % 16) * 2 + k % 2,
               low nibble for k % 8 < 4, high nibble otherwise
n experts dequantized, nb blocks of 32 rows in a slice, Kp (padded) columns, G groups a row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 128
"""Columns per program: 32 rows x 128 columns, 8 KiB of bf16 written."""

FORMAT_CODES = {"bf16": 16, "int8": 8, "int4": 4}


@triton.jit
def _dequant_kernel(w_ptr, scale_ptr, zero_ptr, ids_ptr, out_ptr, nb, Kp, G, group, out_rows, row0,
                    FORMAT: tl.constexpr, ZERO: tl.constexpr, BK: tl.constexpr):
    """out[i, row0 + 32 b + row, k] = weight (row, k) of block b of expert ids[i]."""
    i = tl.program_id(0)
    b = tl.program_id(1)
    e = tl.load(ids_ptr + i).to(tl.int64)
    rows = tl.arange(0, 32)[:, None]  # [32, 1]
    ks = tl.program_id(2) * BK + tl.arange(0, BK)[None, :]  # [1, BK]
    kmask = (ks < Kp) & (rows < 32)  # [32, BK]
    blk = e * nb + b  # the block among all experts' blocks of the slice
    if FORMAT == 4:
        k8 = ks % 8
        byte = ((((ks // 8) * 2 + rows // 16) * 2 + (k8 % 4) // 2) * 16 + rows % 16) * 2 + k8 % 2
        raw = tl.load(w_ptr + blk * (16 * Kp) + byte, mask=kmask, other=0).to(tl.int32)
        code = (raw >> ((k8 // 4) * 4)) & 0xF
        s_off = (blk * G + ks // group) * 32 + rows  # scales [nb][G][32] per expert
        scale = tl.load(scale_ptr + s_off, mask=kmask, other=0.0)
        if ZERO:
            val = (code.to(tl.float32) - tl.load(zero_ptr + s_off, mask=kmask, other=0.0)) * scale
        else:
            val = (code - 8).to(tl.float32) * scale
    else:
        off = ((ks // 2) * 32 + rows) * 2 + ks % 2
        raw = tl.load(w_ptr + blk * (32 * Kp) + off, mask=kmask, other=0)
        if FORMAT == 8:
            val = raw.to(tl.float32) * tl.load(scale_ptr + blk * 32 + rows)  # scales [nb][32]
        else:
            val = raw
    out = out_ptr + ((i * out_rows + row0 + b * 32 + rows).to(tl.int64) * Kp + ks)
    tl.store(out, val.to(out_ptr.dtype.element_ty), mask=kmask)


def dequantize_slice(fmt: str, w: torch.Tensor, scale: torch.Tensor | None, zero: torch.Tensor | None,
                     experts: torch.Tensor, nb: int, Kp: int, group: int, out: torch.Tensor, row0: int) -> None:
    """Write one slice's blocks of experts `experts` [n] into out [n, rows, Kp] from row row0 on.

    w: the slice's flat packed bytes (uint8); scale, zero: its float32 scales and zero points
    viewed from their bytes (None where the format has none).
    """
    n = experts.numel()
    if n == 0 or nb == 0:
        return
    code = FORMAT_CODES[fmt]
    weights = {16: torch.bfloat16, 8: torch.int8, 4: torch.uint8}[code]
    scale = scale.view(torch.float32) if scale is not None else out  # (unread without scales)
    zero_t = zero.view(torch.float32) if zero is not None else scale
    G = Kp // group if code == 4 else 1
    _dequant_kernel[(n, nb, triton.cdiv(Kp, BLOCK_K))](
        w.view(weights), scale, zero_t, experts, out, nb, Kp, G, group, out.shape[1], row0,
        FORMAT=code, ZERO=zero is not None, BK=BLOCK_K)
