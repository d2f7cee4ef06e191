"""Bytes of one routed expert as the native CPU engine reads it and as the GPU keeps it packed: what placement,
the memory checks and the decode floor count."""

from __future__ import annotations

from hybridmoe.errors import HybridMoEError


def cpu_expert_bytes(fmt: str, inter: int, hidden: int, group_size: int) -> int:
    """Bytes the native engine reads for one expert (gate, up [I, H], down [H, I]) in fmt.

    bf16: 2 bytes a weight; int8: 1 byte a weight + a float32 scale per output row; int4: half a
    byte a weight + a float32 scale per group of group_size weights; fp8: 1 byte a weight + a float32 scale
    per 32 rows x 128 columns; mxfp4: half a byte a weight + an e8m0 byte per 32 weights (csrc/moe/packed.h's
    layouts).
    """
    weights = 3 * inter * hidden
    if fmt == "bf16":
        return 2 * weights
    if fmt == "int8":
        return weights + 4 * (2 * inter + hidden)
    if fmt == "int4":
        return weights // 2 + 4 * (weights // group_size)
    if fmt == "fp8":
        return weights + 4 * (2 * -(-inter // 32) * -(-hidden // 128) + -(-hidden // 32) * -(-inter // 128))
    if fmt == "mxfp4":
        return weights // 2 + weights // 32
    raise HybridMoEError(f"unknown expert format {fmt!r}")


def packed_expert_bytes(fmt: str, hidden: int, inter: int, group_size: int, zero_points: bool) -> int:
    """GPU bytes of one expert kept packed in fmt (gate, up [I, H], down [H, I]: PackedMatrix's tensors): the
    CPU engine's codes and scales, without its blocks' padding, plus int4's zero points (a float32 per group)."""
    zeros = 4 * (3 * hidden * inter // group_size) if zero_points and fmt == "int4" else 0
    return cpu_expert_bytes(fmt, inter, hidden, group_size) + zeros
