"""Block-FP8 weights as a checkpoint stores them (DeepSeek-V3): what the native fp8 format packs without float.

One linear W [N out, K in] in blocks of FP8_BLOCK x FP8_BLOCK:
    codes  float8_e4m3fn [N, K]
    scale  float32       [ceil(N / 128), ceil(K / 128)]   (the checkpoint's weight_scale_inv)
    W[n, k] = codes[n, k] * scale[n // 128, k // 128]
The native engine's fp8 format holds these codes and scales as they are (csrc/moe/pack.h Fp8Codes), so it
computes with exactly the checkpoint's weights. The loader hands a backend whose fp8_codes() says so these
in place of float tensors; a consumer that needs float (GPU experts, another format) takes dense().
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from hybridmoe.experts.mxfp4_codes import Mxfp4Codes

FP8_BLOCK = 128
"""Rows and columns of one scale block: the native fp8 format's, and DeepSeek-V3's weight_block_size."""


class Fp8Codes(NamedTuple):
    codes: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype = torch.float32
    """What dense() gives: the dtype the weight would have been handed over in as a float tensor."""

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    def dequantize(self) -> torch.Tensor:
        """W [N, K] float32: each code's value times its block's scale (one rounding, as the engine's)."""
        N, K = self.codes.shape
        scale = self.scale.float().repeat_interleave(FP8_BLOCK, 0)[:N].repeat_interleave(FP8_BLOCK, 1)[:, :K]
        return self.codes.float() * scale

    def dense(self) -> torch.Tensor:
        return self.dequantize().to(self.dtype)


def dense_weights(weights: tuple) -> tuple:
    """One expert's (gate, up, down) with any Fp8Codes or Mxfp4Codes among them dequantized (dense())."""
    return tuple(w.dense() if isinstance(w, (Fp8Codes, Mxfp4Codes)) else w for w in weights)
