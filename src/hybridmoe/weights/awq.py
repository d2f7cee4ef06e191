"""AWQ checkpoints (AutoAWQ "gemm" format): int4 codes packed eight to an int32 along the output dim.

A linear X [out, in] is stored as
  X.qweight int32 [in, out / 8]       nibble j of a word holds output column 8c + ORDER[j]
  X.qzeros  int32 [in / group, out / 8]  packed the same way
  X.scales  fp16  [in / group, out]
and W[o, i] = scales[i // group, o] * (q[i, o] - zero[i // group, o]): in groups of 32/64/128, the
native int4 format with zero points as it is (awq_int4_codes).
"""

from __future__ import annotations

import torch

from hybridmoe.errors import CheckpointError
from hybridmoe.weights.gptq import unpack_cols
from hybridmoe.weights.int4_codes import INT4_GROUPS, Int4Codes

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""AWQ's interleave: nibble j of each int32 holds column ORDER[j] of its eight."""

_UNDO = torch.tensor([ORDER.index(c) for c in range(8)])


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> codes [R, 8C] int32 in column order."""
    nibbles = unpack_cols(packed, 4).reshape(packed.shape[0], -1, 8)  # [R, C, nibble]
    return nibbles[:, :, _UNDO].reshape(packed.shape[0], -1)


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """-> W [out, in] float32."""
    q = unpack_awq(qweight)  # [in, out]
    in_features = q.shape[0]
    group = group_size if group_size > 0 else in_features
    if in_features % group or scales.shape[0] != in_features // group:
        raise CheckpointError(f"AWQ scales [{scales.shape[0]}, ...] do not fit qweight of {in_features} input "
                              f"channels in groups of {group}")
    zeros = unpack_awq(qzeros)
    g = torch.arange(in_features) // group
    return (scales.float()[g] * (q - zeros[g]).float()).T.contiguous()


def awq_int4_codes(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   group_size: int) -> Int4Codes | None:
    """AWQ tensors as native int4 codes (dequantize() equals dequantize_awq bit for bit); None for a group
    size the engine lacks."""
    q = unpack_awq(qweight)  # [in, out]
    if group_size not in INT4_GROUPS or q.shape[0] % group_size or scales.shape[0] != q.shape[0] // group_size:
        return None
    return Int4Codes.from_checkpoint(q, unpack_awq(qzeros), scales)
