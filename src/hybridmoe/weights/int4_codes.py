"""GPTQ/AWQ int4 weights as codes, scales and zero points: what the native engine packs without float.

One linear W [N out, K in] in groups of `group` input channels:
    codes  uint8   [N, K]       0..15
    scales float32 [N, K/group] the checkpoint's fp16 scales, widened (exact)
    zeros  float32 [N, K/group] the integer zero points (GPTQ v1's stored zero + 1)
    W[n, k] = (codes[n, k] - zeros[n, g]) * scales[n, g], g = k // group
which is the native int4 format with zero points term for term (csrc/moe/pack_codes.h), and in
float32 the very numbers the checkpoint's own dequantization gives. Symmetric codes (compressed-tensors' signed
int4 stored as code = q + 8) carry no zeros: W = (codes - 8) * scales, the native int4 format without zero points.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

INT4_GROUPS = (32, 64, 128)
"""Group sizes the native int4 format has."""


SYMMETRIC_ZERO = 8
"""The code of 0 in symmetric int4 (zeros None): W = (codes - 8) * scales, as the engine quantizes int4 without zero
points and compressed-tensors stores its signed int4."""


class Int4Codes(NamedTuple):
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    """None: symmetric, every zero point SYMMETRIC_ZERO (the native int4 format without zero points)."""

    @classmethod
    def from_checkpoint(cls, q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> "Int4Codes":
        """q [K, N], zeros and scales [K/group, N] as GPTQ/AWQ lay them out (input dim first)."""
        return cls(q.T.to(torch.uint8).contiguous(), scales.T.float().contiguous(), zeros.T.float().contiguous())

    @property
    def group(self) -> int:
        return self.codes.shape[-1] // self.scales.shape[-1]

    def dequantize(self) -> torch.Tensor:
        """W [..., N, K] float32, computed as the engine unpacks it."""
        g = self.group
        zeros = SYMMETRIC_ZERO if self.zeros is None else self.zeros.repeat_interleave(g, -1)
        return (self.codes.float() - zeros) * self.scales.repeat_interleave(g, -1)

    def with_zeros(self) -> "Int4Codes":
        """The same weights with their zero points written out (SYMMETRIC_ZERO for symmetric codes)."""
        return self if self.zeros is not None else self._replace(zeros=torch.full_like(self.scales, SYMMETRIC_ZERO))
