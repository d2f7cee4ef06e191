"""GPTQ/AWQ int4 weights as codes, scales and zero points: what the native engine packs without float.

One linear W [N out, K in] in groups of `group` input channels:
    codes  uint8   [N, K]       0..15
    scales float32 [N, K/group] the checkpoint's fp16 scales, widened (exact)
    zeros  float32 [N, K/group] the integer zero points (GPTQ v1's stored zero + 1)
    W[n, k] = (codes[n, k] - zeros[n, g]) * scales[n, g], g = k // group
which is the native int4 format with zero points term for term (csrc/moe/pack_codes.h), and in
float32 the very numbers the checkpoint's own dequantization gives.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

INT4_GROUPS = (32, 64, 128)
"""Group sizes the native int4 format has."""


class Int4Codes(NamedTuple):
    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor

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
        return (self.codes.float() - self.zeros.repeat_interleave(g, -1)) * self.scales.repeat_interleave(g, -1)
