"""DeepSeek-V3's block-FP8 weights: float8_e4m3fn values, one float32 scale per 128x128 block.

A checkpoint stores `X.weight` [out, in] float8_e4m3fn beside `X.weight_scale_inv`
[ceil(out/128), ceil(in/128)]; the real weight is weight * scale_inv, block by block.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn,)
SCALE_SUFFIX = "_scale_inv"


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def dequant_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor,
                      block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """weight [out, in] fp8, scale_inv [ceil(out/bo), ceil(in/bi)] -> [out, in] float32. A block size of 0 spans
    the whole dimension (a per-channel scale is block (1, 0), a per-tensor one (0, 0), stored [1] or [])."""
    out_dim, in_dim = weight.shape
    bo, bi = block[0] or out_dim, block[1] or in_dim
    expected = (-(-out_dim // bo), -(-in_dim // bi))
    if scale_inv.numel() == 1 and expected == (1, 1):
        scale_inv = scale_inv.reshape(1, 1)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale shape {tuple(scale_inv.shape)} does not fit weight {tuple(weight.shape)} "
                         f"in {bo}x{bi} blocks (expected {expected})")
    scale = scale_inv.float().repeat_interleave(bo, dim=0)[:out_dim].repeat_interleave(bi, dim=1)[:, :in_dim]
    return weight.float() * scale
