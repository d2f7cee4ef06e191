"""MXFP4 weights as a checkpoint stores them (gpt-oss; OCP MX FP4): what the native mxfp4 format packs without float.

One linear W [N out, K in] in blocks of 32 input channels:
    codes   uint8 [N, K / 2]    two e2m1 codes a byte: byte j holds k = 2j (bits 0-3) and k = 2j + 1 (bits 4-7)
    scales  uint8 [N, K / 32]   the block's e8m0 exponent s: its scale is 2^(s - 127)
    W[n, k] = E2M1[code of k] * 2^(scales[n, k // 32] - 127)
E2M1 are the 16 values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives (code bit 3 is the sign). The native engine's
mxfp4 format holds these codes and scales as they are (csrc/moe/pack.h Mxfp4Codes), so it computes with exactly the
checkpoint's weights. The loader hands a backend whose takes_mxfp4_codes() says so these in place of float tensors;
a consumer that needs float (another format, GPU experts, the torch reference) takes dense().

dequantize_mxfp4 is the one decoder (weights/mxfp4.py reads checkpoints with it): exact in float32 (an e2m1 value
times a power of two from 2^-128 up is a float32) but where a value overflows: nonzero codes under the largest
scales (2^128 for 255, the OCP spec's NaN, read as transformers reads it) are inf.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The e2m1 value of each 4-bit code."""

BLOCK = 32
"""Values per e8m0 scale (16 bytes of codes)."""

E8M0_BIAS = 127
E8M0_HELD = (2, 252)
"""The e8m0 scales the native mxfp4 format holds under nonzero codes (csrc/moe/packed.h kE8m0Min, kE8m0Max): 2^-125
to 2^125, where every e2m1 value times the scale is a normal bf16."""


def _value_table() -> torch.Tensor:
    """[256 * 256, 2] float32: row 256 s + b holds byte b's two values (its low nibble's first) under e8m0 scale s,
    each E2M1[code] * 2^(s - 127) rounded once to float32 (from float64, where every such product is exact)."""
    codes = torch.arange(256)
    pairs = torch.tensor(E2M1, dtype=torch.float64)[torch.stack((codes & 0xF, codes >> 4), dim=1)]  # [256, 2]
    powers = torch.tensor([2.0 ** (s - E8M0_BIAS) for s in range(256)], dtype=torch.float64)
    return (powers[:, None, None] * pairs).float().reshape(256 * 256, 2)


_VALUES = _value_table()


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> float32 [..., G * 32]: row by row, each block's 32 values
    (low nibble before high) times its scale."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not fit: blocks "
                         f"[..., G, {BLOCK // 2}] take scales [..., G]")
    rows = (scales.long() << 8).unsqueeze(-1) | blocks.long()  # [..., G, 16]: a row of _VALUES per byte
    return _VALUES[rows].flatten(-3)


def unheld_scales(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Indexes [n, 2] (row, block) of the blocks whose scale is outside E8M0_HELD under a nonzero code (codes
    [N, K / 2], scales [N, K / 32]): what the native mxfp4 format refuses. One pass over the scales; the codes of
    only those blocks are read."""
    lo, hi = E8M0_HELD
    outside = ((scales < lo) | (scales > hi)).nonzero()
    if not len(outside):
        return outside
    blocks = codes.view(*scales.shape, BLOCK // 2)[outside[:, 0], outside[:, 1]]  # [n, 16]
    return outside[((blocks & 0x77) != 0).any(dim=1)]


class Mxfp4Codes(NamedTuple):
    codes: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype = torch.float32
    """What dense() gives: the dtype the weight would have been handed over in as a float tensor."""

    @property
    def shape(self) -> torch.Size:
        """W's [N, K]."""
        return torch.Size((self.codes.shape[0], self.codes.shape[1] * 2))

    def dequantize(self) -> torch.Tensor:
        """W [N, K] float32 (dequantize_mxfp4: one rounding where a value overflows, none otherwise)."""
        N, half = self.codes.shape
        return dequantize_mxfp4(self.codes.reshape(N, half // (BLOCK // 2), BLOCK // 2), self.scales)

    def dense(self) -> torch.Tensor:
        return self.dequantize().to(self.dtype)
