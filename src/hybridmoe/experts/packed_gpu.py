"""GPU-resident routed experts kept as int4 / int8 codes and scales.

With int4 or int8 CPU experts, the experts the placement puts on the GPU are packed by the same
native packer (the same codes and scales as if they lived on the CPU, so an expert computes the
same wherever it is placed), copied to the GPU and regrouped there into a layout whose rows are
contiguous runs of bytes (PackedMatrix; the CPU's 32-row blocks would make a GPU kernel gather
every byte): a quarter (int4) or half (int8) of bf16's memory, so the budget holds four or two
times as many experts. The GPU share's Triton kernels (gpu_experts_triton.py) read the codes and
dequantize each tile in registers; nothing on the GPU holds a dequantized copy.

Under a 16 GiB budget a Qwen3-30B-A3B layer holds 97 int4 experts packed against 25 in bf16, and decodes
~1.3x faster (EngineConfig.gpu_experts_packed, on by default).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridmoe.experts.packed_torch import PackedLayout
from hybridmoe.platform import HAVE_TRITON

PACKED_FORMATS = ("int4", "int8")


@dataclass(frozen=True)
class PackedMatrix:
    """One projection (gate, up or down) of a layer's GPU experts, its integer codes and scales on the GPU.

    int4: codes uint8 [E, N, K / 2]; in each group of `group` columns, byte p (p < group / 2) holds column
    p in its low nibble and column group / 2 + p in its high one (so a kernel's tile of bytes is two
    tiles of columns, each a run of half-groups); scale (and zero, with zero points) float32 [E, N, K / group].
    int8: codes int8 [E, N, K], scale float32 [E, N, 1], group K.
    W = (code - zero) * scale, zero 8 for symmetric int4 and 0 for int8: the CPU engine's values. dtype: what
    the kernels round each weight to (the model's compute dtype).
    """

    format: str
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    group: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, int, int]:
        E, N, width = self.codes.shape
        return E, N, width * 2 if self.format == "int4" else width

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def dense(self) -> torch.Tensor:
        """[E, N, K] in dtype: the weights the kernels compute with (the torch fallback's input)."""
        E, N, K = self.shape
        W = torch.empty(E, N, K, dtype=self.dtype, device=self.device)
        if self.format == "int8":
            torch.mul(self.codes, self.scale, out=W)  # float32 code * scale, rounded once
            return W
        G = K // self.group
        b = self.codes.view(E, N, G, self.group // 2)
        q = torch.cat((b & 0xF, b >> 4), dim=-1)  # [E, N, G, group] codes in column order
        q = q - self.zero.unsqueeze(-1) if self.zero is not None else q.view(torch.int8) - 8
        torch.mul(q, self.scale.unsqueeze(-1), out=W.view(E, N, G, self.group))
        return W


def kernel_weight_args(w) -> tuple:
    """(weights, scale, zero, stride over experts, stride over rows, FORMAT, ZERO, GROUP) of a dense [E, N, K]
    tensor or a PackedMatrix, for the Triton kernels (gpu_experts_triton.py, gpu_experts_gemv_triton.py)."""
    if isinstance(w, torch.Tensor):
        return w, w, w, w.stride(0), w.stride(1), 0, False, 32
    _, N, K = w.shape
    zero = w.zero if w.zero is not None else w.scale  # (unread without zero points)
    fmt = {"int4": 4, "int8": 8}[w.format]
    return w.codes, w.scale, zero, N * K, K, fmt, w.zero is not None, w.group if fmt == 4 else 32


def packed_gpu_format(expert_backend: str, expert_format: str, device: str | torch.device, dtype: torch.dtype,
                      enabled: bool = True) -> str | None:
    """The packed format GPU-resident experts are kept in, or None for dense weights in the model's dtype.

    Packed where the CPU experts are int4 / int8 in the native engine and the GPU share runs the Triton
    kernels (CUDA with triton) in bf16 / fp16; a float32 model keeps exact dense weights, and so do fp8 and mxfp4
    CPU experts' GPU share (no GPU kernel reads their codes: HybridExperts takes those experts in float as they
    load, dequantizing block-FP8 codes).
    """
    if not enabled or expert_backend != "native" or expert_format not in PACKED_FORMATS:
        return None
    if torch.device(device).type != "cuda" or not HAVE_TRITON or dtype not in (torch.bfloat16, torch.float16):
        return None
    return expert_format


def pack_gpu_experts(packed_layer, device: torch.device, dtype: torch.dtype) -> tuple[PackedMatrix, ...]:
    """(gate, up, down) PackedMatrix on device from a CpuExperts over the GPU experts (packed on the CPU,
    then dropped by the caller): its bytes are copied once and regrouped on the device."""
    state = packed_layer.packed_state()
    layout = PackedLayout(state)
    experts = torch.arange(layout.E, device=device)
    out = []
    for mat in layout.matrices:  # one matrix's bytes on the device at a time: less to hold while loading
        names = [n for sl in mat.slices for n in (sl.w, sl.scale, sl.zero) if n is not None]
        buffers = {n: torch.as_tensor(state["buffers"][n]).view(torch.uint8).reshape(-1).to(device) for n in names}
        codes, scale, zero = layout.codes(mat, buffers, experts)
        del buffers
        group = layout.group if layout.format == "int4" else mat.K
        if layout.format == "int4":  # columns p and group / 2 + p of each group into one byte
            E, N, K = codes.shape
            halves = codes.reshape(E, N, K // group, 2, group // 2)
            codes = (halves[..., 0, :] | (halves[..., 1, :] << 4)).reshape(E, N, K // 2)
        out.append(PackedMatrix(layout.format, codes.contiguous(), scale.contiguous(),
                                None if zero is None else zero.contiguous(), group, dtype))
    return tuple(out)
