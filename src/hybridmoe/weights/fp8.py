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
    """weight [out, in] fp8, scale_inv [ceil(out/bo), ceil(in/bi)] -> [out, in] float32."""
    out_dim, in_dim = weight.shape
    bo, bi = block
    expected = (-(-out_dim // bo), -(-in_dim // bi))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale shape {tuple(scale_inv.shape)} does not fit weight {tuple(weight.shape)} "
                         f"in {bo}x{bi} blocks (expected {expected})")
    scale = scale_inv.float().repeat_interleave(bo, dim=0)[:out_dim].repeat_interleave(bi, dim=1)[:, :in_dim]
    return weight.float() * scale
