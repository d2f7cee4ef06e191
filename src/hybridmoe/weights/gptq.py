"""GPTQ checkpoints (AutoGPTQ / GPTQModel "gptq" format): one int4/int8 code per weight, packed in int32.

A linear X [out, in] is stored as
  X.qweight int32 [in * bits / 32, out]   codes packed along the input dim, low bits first
  X.qzeros  int32 [groups, out * bits / 32] zero points packed along the output dim
  X.scales  fp16  [groups, out]
  X.g_idx   int32 [in]                    the group of each input channel (desc_act permutes it)
and W[o, i] = scales[g, o] * (q[i, o] - zero[g, o]) with g = g_idx[i]. The original ("gptq",
v1) format stores zero - 1; checkpoint_format "gptq_v2" stores the zero itself.
"""

from __future__ import annotations

import torch

from hybridmoe.errors import CheckpointError


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] holding 32/bits codes per element, low bits first -> [R * 32/bits, C] int32 codes."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32).view(1, per, 1)
    codes = (packed.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(packed.shape[0] * per, packed.shape[1])


def unpack_cols(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] holding 32/bits codes per element, low bits first -> [R, C * 32/bits] int32 codes."""
    return unpack_rows(packed.T.contiguous(), bits).T


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                    bits: int, group_size: int, v1_zeros: bool = True) -> torch.Tensor:
    """-> W [out, in] float32 (the layout of a torch Linear weight)."""
    if bits not in (2, 4, 8):
        raise CheckpointError(f"GPTQ with {bits} bits is not supported (2, 4 or 8)")
    q = unpack_rows(qweight, bits)  # [in, out]
    in_features, out_features = q.shape
    zeros = unpack_cols(qzeros, bits)[:, :out_features] + (1 if v1_zeros else 0)  # [groups, out]
    if g_idx is None:
        g_idx = torch.arange(in_features) // (group_size if group_size > 0 else in_features)
    g = g_idx.long()
    if g.numel() != in_features or int(g.max()) >= scales.shape[0]:
        raise CheckpointError(f"GPTQ g_idx of {g.numel()} channels does not fit qweight [{in_features}, "
                              f"{out_features}] with {scales.shape[0]} groups")
    w = scales.float()[g] * (q - zeros[g]).float()  # [in, out]
    return w.T.contiguous()
