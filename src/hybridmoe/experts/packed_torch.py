"""The native engine's packed expert layouts (csrc/moe/packed.h), dequantized with torch on any device
(on CUDA with triton, by one kernel instead: experts/packed_triton.py, the same values).

The CPU engine keeps each layer's experts packed (CpuExperts.packed_state()); a long prefill can copy
those bytes to the GPU as they are (a quarter of bf16's for int4) and unpack them there. The values
equal CpuExperts.dequantized bit for bit in float32: the same integer codes, the same
(code - zero) * scale in float32 (tests/hybrid/test_packed_torch.py holds every format to that).

Every matrix W [N, K] is cut into blocks of 32 output rows, and the blocks into `numa_nodes` slices;
slice s of all E experts is one buffer "<gate|up|down>.<s>.w" (+ ".scale", ".zero"):
  bf16 / int8 block: [Kp/2][32 rows][2]                  (k = 2 * pair + j)
  int4 block:        [Kp/8][2 halves][2 quads][16 rows][2] bytes, low nibble k8 = 2*quad + j,
                     high nibble k8 = 4 + 2*quad + j, row = 16 * half + r, k = 8 * step + k8
  fp8 block:         [Kp/2][32 rows][2] e4m3 codes, as int8
  mxfp4 block:       [Kp/8][2 halves][16 rows][2 j][2 bytes] e2m1 codes, byte b's low nibble k = 8 * step + 4b + j,
                     its high nibble k + 2
  int8 scales [nb][32] per row; int4 scales (and zero points) [nb][G][32] per (row, group); fp8 scales
  [nb][ceil(Kp/128)] per (block, 128 columns); mxfp4 e8m0 bytes [nb][Kp/32][32] per (row, 32 columns), 2^(e - 127).
E experts, n of them dequantized, N rows, K columns (Kp padded), nb blocks of a slice, G groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.mxfp4_codes import E2M1
from hybridmoe.platform import HAVE_TRITON

BLOCK_ROWS = 32
MATRICES = ("gate", "up", "down")


FORMATS = ("bf16", "int8", "int4", "fp8", "mxfp4")
TRITON_FORMATS = ("bf16", "int8", "int4")
"""The formats experts/packed_triton.py dequantizes; fp8 and mxfp4 run the torch version everywhere."""
FP8_GROUP = 128
"""Columns per fp8 scale (csrc/moe/packed.h kFp8GroupK)."""
MXFP4_GROUP = 32
"""Columns per mxfp4 scale (csrc/moe/packed.h kMxfp4GroupK)."""


def fused_dequant(device: torch.device, fmt: str) -> bool:
    """Whether PackedLayout.dequantize of format fmt runs as one Triton pass on device (no torch temporaries)."""
    return device.type == "cuda" and HAVE_TRITON and fmt in TRITON_FORMATS


@dataclass(frozen=True)
class _Slice:
    blocks: int
    w: str
    scale: str | None
    zero: str | None


@dataclass(frozen=True)
class _Matrix:
    N: int
    K: int
    Kp: int
    slices: tuple[_Slice, ...]


class PackedLayout:
    """Where each expert's bytes sit in a layer's packed buffers, read from a packed_state()."""

    def __init__(self, state: dict):
        self.E, self.H, self.I = (int(v) for v in state["shape"])
        self.format, self.group = state["format"], int(state["group_size"])
        self.zero_points = bool(state["zero_points"])
        numa = int(state["numa_nodes"])
        if self.format not in FORMATS:
            raise HybridMoEError(f"unknown packed expert format {self.format!r}")
        mats = []
        for m, name in enumerate(MATRICES):
            N, K = (self.I, self.H) if m < 2 else (self.H, self.I)
            Kp = K if self.format in ("int4", "mxfp4") else -(-K // BLOCK_ROWS) * BLOCK_ROWS
            blocks = -(-N // BLOCK_ROWS)
            bounds = [blocks * s // numa for s in range(numa + 1)]
            slices = tuple(_Slice(bounds[s + 1] - bounds[s], f"{name}.{s}.w",
                                  f"{name}.{s}.scale" if self.format != "bf16" else None,
                                  f"{name}.{s}.zero" if self.format == "int4" and self.zero_points else None)
                           for s in range(numa))
            mats.append(_Matrix(N, K, Kp, slices))
        self.matrices: tuple[_Matrix, ...] = tuple(mats)

    def buffer_bytes(self) -> dict[str, int]:
        """Name -> size in bytes of every packed buffer (what packed_state()["buffers"] holds)."""
        out = {}
        for mat in self.matrices:
            block = BLOCK_ROWS * mat.Kp * {"bf16": 2, "int8": 1, "int4": 0.5, "fp8": 1, "mxfp4": 0.5}[self.format]
            scale_bytes = {"bf16": 0, "int8": 4 * BLOCK_ROWS, "int4": 4 * BLOCK_ROWS * mat.Kp // self.group,
                           "fp8": 4 * -(-mat.Kp // FP8_GROUP), "mxfp4": BLOCK_ROWS * mat.Kp // MXFP4_GROUP}[self.format]
            for sl in mat.slices:
                out[sl.w] = int(self.E * sl.blocks * block)
                for name in (sl.scale, sl.zero):
                    if name is not None:
                        out[name] = self.E * sl.blocks * scale_bytes
        return out

    def dequantize(self, buffers: dict[str, torch.Tensor], experts: torch.Tensor, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Experts `experts` (ids [n] on the buffers' device) as (gate, up [n, I, H], down [n, H, I]) in dtype.

        buffers: name -> the flat packed buffer as uint8 bytes, on the device that does the work.
        """
        return tuple(self.matrix(mat, buffers, experts, dtype) for mat in self.matrices)

    def matrix(self, mat: _Matrix, buffers: dict[str, torch.Tensor], experts: torch.Tensor, dtype) -> torch.Tensor:
        """One of self.matrices for experts `experts`, [n, N, K] in dtype (dequantize's parts)."""
        if fused_dequant(experts.device, self.format):
            return self._matrix_triton(mat, buffers, experts, dtype)
        rows = [self._slice(mat, sl, buffers, experts, dtype) for sl in mat.slices]  # each [n, nb * 32, K]
        return torch.cat(rows, dim=1)[:, :mat.N] if len(rows) > 1 else rows[0][:, :mat.N]

    def _matrix_triton(self, mat: _Matrix, buffers: dict[str, torch.Tensor], experts: torch.Tensor, dtype
                       ) -> torch.Tensor:
        from hybridmoe.experts.packed_triton import dequantize_slice

        blocks = sum(sl.blocks for sl in mat.slices)
        out = torch.empty(experts.numel(), blocks * BLOCK_ROWS, mat.Kp, dtype=dtype, device=experts.device)
        row0 = 0
        for sl in mat.slices:
            dequantize_slice(self.format, buffers[sl.w], sl.scale and buffers[sl.scale], sl.zero and buffers[sl.zero],
                             experts, sl.blocks, mat.Kp, self.group, out, row0)
            row0 += sl.blocks * BLOCK_ROWS
        return out[:, :mat.N, :mat.K]  # [n, N, K], rows padded to blocks and columns to Kp left out

    def codes(self, mat: _Matrix, buffers: dict[str, torch.Tensor], experts: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """An int4 / int8 matrix of experts `experts` [n] as integer codes [n, N, K] (int4: uint8 0..15, int8:
        int8), float32 scales [n, N, G] (int8: G = 1) and zero points like the scales (int4 with zero points,
        else None): W = (codes - zero) * scale per group, zero 8 for symmetric int4 and 0 for int8."""
        parts = [self._slice_codes(mat, sl, buffers, experts) for sl in mat.slices]  # each (codes, scale, zero)

        def rows(i: int) -> torch.Tensor | None:  # part i of every slice, their rows joined
            ts = [p[i] for p in parts]
            return None if ts[0] is None else ts[0] if len(ts) == 1 else torch.cat(ts, dim=1)

        codes, scale, zero = rows(0), rows(1), rows(2)
        return codes[:, :mat.N, :mat.K], scale[:, :mat.N], None if zero is None else zero[:, :mat.N]

    def _slice_codes(self, mat: _Matrix, sl: _Slice, buffers, experts: torch.Tensor):
        """codes [n, nb * 32, Kp], scale [n, nb * 32, G] and zero (or None) of one slice (see codes)."""
        n, nb, Kp = experts.numel(), sl.blocks, mat.Kp
        # Each block's rows and K pairs are transposed as whole pairs (int16 int8 or int4 byte pairs): a 4-d
        # copy of few wide elements, where one over every weight was slow on GPUs.
        w = buffers[sl.w].view(self.E, -1)[experts]  # [n, nb * block bytes]
        scale = buffers[sl.scale].view(torch.float32).view(self.E, nb, -1)[experts]  # [n, nb, 32 or G * 32]
        if self.format == "int8":
            q = w.view(torch.int16).view(n, nb, Kp // 2, BLOCK_ROWS).transpose(2, 3).contiguous()
            return q.view(torch.int8).view(n, nb * BLOCK_ROWS, Kp), scale.reshape(n, nb * BLOCK_ROWS, 1), None
        pairs = w.view(torch.int16).view(n, nb, Kp // 8, 2, 2, 16)  # [n, nb, step, half, quad, r] of (j) pairs
        b = pairs.permute(0, 1, 3, 5, 2, 4).contiguous().view(torch.uint8)  # [n, nb, half, r, step, 2 quad x 2 j]
        q = torch.stack((b & 0xF, b >> 4), dim=-2)  # [n, nb, half, r, step, hi, 4]: k8 = 4 * hi + 2 * quad + j
        G = Kp // self.group
        scale = scale.view(n, nb, G, BLOCK_ROWS).transpose(2, 3).reshape(n, nb * BLOCK_ROWS, G)
        zero = None
        if sl.zero is not None:
            zero = buffers[sl.zero].view(torch.float32).view(self.E, nb, G, BLOCK_ROWS)[experts]
            zero = zero.transpose(2, 3).reshape(n, nb * BLOCK_ROWS, G)
        return q.view(n, nb * BLOCK_ROWS, Kp), scale, zero

    def _slice_fp8(self, mat: _Matrix, sl: _Slice, buffers, experts: torch.Tensor, dtype) -> torch.Tensor:
        """One fp8 slice [n, nb * 32, K]: each code's value times its (block, 128 columns) scale in float32."""
        n, nb, Kp = experts.numel(), sl.blocks, mat.Kp
        w = buffers[sl.w].view(self.E, -1)[experts]  # [n, nb * block bytes]
        q = w.view(torch.int16).view(n, nb, Kp // 2, BLOCK_ROWS).transpose(2, 3).contiguous()  # code pairs
        scale = buffers[sl.scale].view(torch.float32).view(self.E, nb, -1)[experts]  # [n, nb, G]
        scale = scale.repeat_interleave(FP8_GROUP, dim=2)[..., None, :Kp]  # [n, nb, 1, Kp]
        W = torch.empty(n, nb, BLOCK_ROWS, Kp, dtype=dtype, device=w.device)
        torch.mul(q.view(torch.float8_e4m3fn).view(n, nb, BLOCK_ROWS, Kp).float(), scale, out=W)
        return W.view(n, nb * BLOCK_ROWS, Kp)[..., :mat.K]

    def _slice_mxfp4(self, mat: _Matrix, sl: _Slice, buffers, experts: torch.Tensor, dtype) -> torch.Tensor:
        """One mxfp4 slice [n, nb * 32, K]: each code's e2m1 value times its (row, 32 columns) scale in float32."""
        n, nb, Kp = experts.numel(), sl.blocks, mat.Kp
        b = buffers[sl.w].view(self.E, -1)[experts].view(n, nb, Kp // 8, 2, 16, 2, 2)  # [n, nb, step, half, r, j, b]
        codes = torch.stack((b & 0xF, b >> 4), dim=-1)  # [..., j, b, t]: k = 8 * step + 2 * (2b + t) + j
        codes = codes.permute(0, 1, 3, 4, 2, 6, 7, 5).reshape(n, nb * BLOCK_ROWS, Kp)
        values = torch.tensor(E2M1, dtype=torch.float32, device=b.device)[codes.long()]
        e = buffers[sl.scale].view(self.E, nb, Kp // MXFP4_GROUP, BLOCK_ROWS)[experts]  # [n, nb, G, 32]
        scale = (e.transpose(2, 3).reshape(n, nb * BLOCK_ROWS, -1).int() << 23).view(torch.float32)  # 2^(e - 127)
        W = torch.empty(n, nb * BLOCK_ROWS, Kp, dtype=dtype, device=b.device)
        torch.mul(values.view(n, nb * BLOCK_ROWS, -1, MXFP4_GROUP), scale.unsqueeze(-1),
                  out=W.view(n, nb * BLOCK_ROWS, -1, MXFP4_GROUP))
        return W[..., :mat.K]

    def _slice(self, mat: _Matrix, sl: _Slice, buffers, experts: torch.Tensor, dtype) -> torch.Tensor:
        # The products are float32, as the engine's, and rounded to dtype by the multiplication that
        # makes them (one pass; what .to(dtype) of the float32 result gives).
        n, nb, Kp = experts.numel(), sl.blocks, mat.Kp
        if self.format == "bf16":
            w = buffers[sl.w].view(self.E, -1)[experts]  # [n, nb * block bytes]
            q = w.view(torch.int32).view(n, nb, Kp // 2, BLOCK_ROWS).transpose(2, 3).contiguous()
            return q.view(torch.bfloat16).view(n, nb * BLOCK_ROWS, Kp)[..., :mat.K].to(dtype)
        if self.format == "fp8":
            return self._slice_fp8(mat, sl, buffers, experts, dtype)
        if self.format == "mxfp4":
            return self._slice_mxfp4(mat, sl, buffers, experts, dtype)
        q, scale, zero = self._slice_codes(mat, sl, buffers, experts)
        W = torch.empty(q.shape, dtype=dtype, device=q.device)
        if self.format == "int8":
            torch.mul(q, scale, out=W)  # float(code) * scale
            return W[..., :mat.K]
        G = Kp // self.group
        q = q.view(n, nb * BLOCK_ROWS, G, self.group)
        if zero is not None:
            q = q - zero.unsqueeze(-1)  # float32 code - zero point
        else:
            q = q.view(torch.int8) - 8  # code - 8, exact in int8 (and so in float32)
        torch.mul(q, scale.unsqueeze(-1), out=W.view(q.shape))
        return W
