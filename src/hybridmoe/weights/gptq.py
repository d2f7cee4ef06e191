"""GPTQ checkpoints (AutoGPTQ / GPTQModel "gptq" format): one int4/int8 code per weight, packed in int32.

A linear X [out, in] is stored as
  X.qweight int32 [in * bits / 32, out]   codes packed along the input dim, low bits first
  X.qzeros  int32 [groups, out * bits / 32] zero points packed along the output dim
  X.scales  fp16  [groups, out]
  X.g_idx   int32 [in]                    the group of each input channel (desc_act permutes it)
and W[o, i] = scales[g, o] * (q[i, o] - zero[g, o]) with g = g_idx[i]. The original ("gptq",
v1) format stores zero - 1; checkpoint_format "gptq_v2" stores the zero itself.

4-bit weights in groups of 32/64/128 whose g_idx is the plain order (desc_act false, or an identity
permutation) map onto the native int4 format as they are (gptq_int4_codes). With desc_act's real
permutation a group's channels lie scattered over the input dim, while the engine's groups are
contiguous runs of K (and its gate/up inputs are shared by every expert, so they cannot be permuted
per expert): such weights are dequantized to float and re-quantized by the engine.
"""

from __future__ import annotations

import torch

from hybridmoe.errors import CheckpointError
from hybridmoe.weights.int4_codes import INT4_GROUPS, Int4Codes


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


def gptq_int4_codes(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
                    group_size: int, v1_zeros: bool = True) -> Int4Codes | None:
    """4-bit GPTQ tensors as native int4 codes; None where they do not map (a permuted g_idx, a group size
    the engine lacks). Their dequantize() equals dequantize_gptq bit for bit."""
    q = unpack_rows(qweight, 4)  # [in, out]
    in_features, out_features = q.shape
    if group_size not in INT4_GROUPS or in_features % group_size or scales.shape[0] != in_features // group_size:
        return None
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(in_features) // group_size):
        return None
    zeros = unpack_cols(qzeros, 4)[:, :out_features] + (1 if v1_zeros else 0)  # [groups, out]
    return Int4Codes.from_checkpoint(q, zeros, scales)
