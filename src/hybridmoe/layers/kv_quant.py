"""Cache rows stored as they are, or in float8 (e4m3) with a float32 scale per row: writing through a cache's
flat rows and reading a sequence's positions back through its block table, in the compute dtype.

A row is one token's vector of one key/value head (GQA) or one token's latent (MLA); its scale is its largest
magnitude over e4m3's largest finite value (448), so every value keeps e4m3's 3 mantissa bits (a relative
error of at most 1/16) whatever the row's range. A scale per row rather than per block lets a block fill token
by token: a block-wide scale fixed by its first token would clip a later, larger one, and recomputing it would
mean requantizing the rows already there.
"""

from __future__ import annotations

from functools import cache

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@cache
def kernels_read_fp8(device: torch.device) -> bool:
    """Whether the Triton kernels can read a float8 cache on this CUDA device: Triton converts e4m3 from compute
    capability 8.9 on (Ada, Hopper and later); an older GPU reads it through the torch path."""
    return torch.cuda.get_device_capability(device) >= (8, 9)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (float8 [..., D], float32 scale [..., 1]) with x ~ codes * scale."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / FP8_MAX
    return (x / scale).to(FP8), scale


def write_rows(store: torch.Tensor, scale: torch.Tensor | None, rows: torch.Tensor, x: torch.Tensor) -> None:
    """x [T, ...] into flat rows [T] of store [NB, BS, ...] (quantized when scale, [NB, BS, ..., 1], is given)."""
    if scale is None:
        store.view(-1, *store.shape[2:])[rows] = x
        return
    codes, s = quantize_rows(x)
    store.view(-1, *store.shape[2:])[rows] = codes
    scale.view(-1, *scale.shape[2:])[rows] = s


def gather_positions(cache: torch.Tensor, table_rows: torch.Tensor, length: int,
                     first_block: int | None = None) -> torch.Tensor:
    """The first length positions of each listed slot, contiguous: cache [NB, BS, ...], table_rows [M] or
    [B, M] -> [length, ...] or [B, length, ...]. first_block: the one slot's blocks are first_block,
    first_block + 1, ... (the caller knows it on the host), so its positions are a view of the cache, not a copy."""
    bs, nb = cache.shape[1], -(-length // cache.shape[1])
    if first_block is not None:
        got = cache[first_block:first_block + nb].reshape(nb * bs, *cache.shape[2:])[:length]
        return got if table_rows.dim() == 1 else got.unsqueeze(0)
    blocks = table_rows[..., :nb].long()
    got = cache[blocks]  # [(B,) nb, BS, ...]
    got = got.reshape(*blocks.shape[:-1], nb * bs, *cache.shape[2:])
    return got.narrow(blocks.dim() - 1, 0, length)


def read_positions(store: torch.Tensor, scale: torch.Tensor | None, table_rows: torch.Tensor, length: int,
                   dtype: torch.dtype, first_block: int | None = None) -> torch.Tensor:
    """gather_positions of store, dequantized to dtype when scale is given."""
    got = gather_positions(store, table_rows, length, first_block)
    if scale is None:
        return got
    return (got.float() * gather_positions(scale, table_rows, length, first_block)).to(dtype)
