"""GPU-resident routed experts kept in the native engine's packed int4 / int8 layout.

With int4 or int8 CPU experts, the experts the placement puts on the GPU are packed by the same
native packer (the same codes and scales as if they lived on the CPU, so an expert computes the
same wherever it is placed) and their bytes copied to the GPU as they are: a quarter (int4) or
half (int8) of bf16's memory, so the budget holds four or two times as many experts. The GPU
share's Triton kernels (gpu_experts_triton.py) read the packed bytes and dequantize each tile in
registers; nothing on the GPU holds a dequantized copy.

Layout (experts/packed_torch.py's docstring): one buffer per projection, E experts one after
the other, each a run of 32-row blocks; numa_nodes 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridmoe.experts.gpu_experts import HAVE_TRITON
from hybridmoe.experts.packed_torch import PackedLayout

PACKED_FORMATS = ("int4", "int8")


@dataclass(frozen=True)
class PackedMatrix:
    """One projection (gate, up or down) of a layer's GPU experts in the packed layout, on the GPU.

    w: the packed bytes (uint8, flat); scale (and zero, int4 with zero points): float32, flat.
    shape (E, N, K) as the dense [E, N, K] weight it stands for; dtype: what the kernels round each
    dequantized weight to (the model's compute dtype).
    """

    format: str
    w: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    shape: tuple[int, int, int]
    Kp: int
    group: int
    dtype: torch.dtype
    layout: PackedLayout
    index: int  # 0 gate, 1 up, 2 down: this matrix among layout.matrices

    @property
    def device(self) -> torch.device:
        return self.w.device

    def dense(self) -> torch.Tensor:
        """[E, N, K] in dtype: the weights the kernels compute with (the torch fallback's input)."""
        sl = self.layout.matrices[self.index].slices[0]
        buffers = {sl.w: self.w, sl.scale: self.scale.view(torch.uint8)}
        if sl.zero is not None:
            buffers[sl.zero] = self.zero.view(torch.uint8)
        experts = torch.arange(self.shape[0], device=self.device)
        return self.layout.matrix(self.layout.matrices[self.index], buffers, experts, self.dtype)


def packed_gpu_format(expert_backend: str, expert_format: str, device: str | torch.device, dtype: torch.dtype,
                      enabled: bool = True) -> str | None:
    """The packed format GPU-resident experts are kept in, or None for dense weights in the model's dtype.

    Packed where the CPU experts are int4 / int8 in the native engine and the GPU share runs the Triton
    kernels (CUDA with triton) in bf16 / fp16; a float32 model keeps exact dense weights.
    """
    if not enabled or expert_backend != "native" or expert_format not in PACKED_FORMATS:
        return None
    if torch.device(device).type != "cuda" or not HAVE_TRITON or dtype not in (torch.bfloat16, torch.float16):
        return None
    return expert_format


def packed_expert_bytes(fmt: str, hidden: int, inter: int, group_size: int, zero_points: bool) -> int:
    """GPU bytes of one expert packed in fmt, padding included (what pack_gpu_experts copies per expert)."""
    layout = PackedLayout({"shape": [1, hidden, inter], "format": fmt, "group_size": group_size,
                           "zero_points": zero_points and fmt == "int4", "numa_nodes": 1})
    return sum(layout.buffer_bytes().values())


def pack_gpu_experts(packed_layer, device: torch.device, dtype: torch.dtype) -> tuple[PackedMatrix, ...]:
    """(gate, up, down) PackedMatrix on device from a CpuExperts over the GPU experts (packed on the CPU,
    then dropped by the caller): each buffer is copied once."""
    state = packed_layer.packed_state()
    if int(state["numa_nodes"]) != 1:
        raise ValueError("GPU experts are packed with numa_nodes=1")
    layout = PackedLayout(state)
    buffers = state["buffers"]

    def on_device(name: str | None) -> torch.Tensor | None:
        if name is None:
            return None
        return torch.as_tensor(buffers[name]).view(torch.uint8).reshape(-1).to(device)

    out = []
    for m, mat in enumerate(layout.matrices):
        sl = mat.slices[0]
        out.append(PackedMatrix(layout.format, on_device(sl.w), on_device(sl.scale).view(torch.float32),
                                None if sl.zero is None else on_device(sl.zero).view(torch.float32),
                                (layout.E, mat.N, mat.K), mat.Kp, layout.group, dtype, layout, m))
    return tuple(out)
