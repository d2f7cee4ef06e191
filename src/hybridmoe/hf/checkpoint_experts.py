"""A safetensors checkpoint's routed experts, read layer by layer and packed straight into CpuExperts.

A routed expert's tensor is named {prefix}.experts.{rest}, its prefix ending in layers.{L}.{block} (block: mlp, or
Mixtral's and MiniMax-M2's block_sparse_moe, which transformers renames to mlp). rest is either one of the
module's fused parts (gate_up_proj, ...: family_layouts.py's layout, as the module holds them) or {e}.{name}.weight,
one expert's projection under the family's checkpoint names. Shared experts (shared_expert., shared_experts.)
are not routed experts and stay with the model's other weights.

Each expert is read as a view of the memory-mapped file, checked against the shape transformers' own module
expects (a reference built on the meta device from the model's config), cast to the model's dtype as
transformers' own load casts it (so the packed experts are those offload_experts makes of transformers' load),
and packed, one expert at a time (CpuExperts.from_experts); once its layer is packed, the layer's mapped pages
are dropped from the resident set (SafetensorsCheckpoint.release), so reading never holds more than one layer
of the checkpoint's experts.

Quantized checkpoints hand the engine their codes: a block-FP8 expert matrix X.weight (float8_e4m3fn, beside
X.weight_scale_inv, one float32 scale per 128x128 block; DeepSeek-V3, GLM-4.5-FP8) is read as Fp8Codes, and an
MXFP4 fused part X (X_blocks and X_scales; gpt-oss) as each expert's Mxfp4Codes, its gate and up rows split as the
layout splits the float part. The native fp8 / mxfp4 format packs those codes as they are; any other format
dequantizes one expert at a time (Fp8Codes.dense, Mxfp4Codes.dense, in the model's dtype) and packs that.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from hybridmoe.errors import CheckpointError, HybridMoEError
from hybridmoe.experts.cpu_experts import CpuExperts
from hybridmoe.experts.fp8_codes import Fp8Codes
from hybridmoe.experts.mxfp4_codes import BLOCK as MXFP4_BLOCK
from hybridmoe.experts.mxfp4_codes import Mxfp4Codes
from hybridmoe.hf.family_layouts import ExpertsLayout, Family
from hybridmoe.weights.fp8 import scale_name
from hybridmoe.weights.mxfp4 import BLOCKS, SCALES
from hybridmoe.weights.safetensors import SafetensorsCheckpoint

EXPERT_TENSOR = re.compile(r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+)\.[^.]+\.experts)\.(?P<rest>.+)$")
"""A routed expert's tensor name: its layer's prefix, the layer index, and the rest after `experts.`."""


def is_expert_tensor(name: str) -> bool:
    return EXPERT_TENSOR.match(name) is not None


class CheckpointExperts:
    """Where each layer's routed experts lie in a checkpoint, and their packing."""

    def __init__(self, ckpt: SafetensorsCheckpoint, family: Family, dtype: torch.dtype):
        """dtype: the model's, which each expert tensor is cast to before packing."""
        self.ckpt, self.family, self.dtype = ckpt, family, dtype
        self.prefixes: dict[int, str] = {}
        for name in ckpt.file_of:
            match = EXPERT_TENSOR.match(name)
            if match is None:
                continue
            prefix = self.prefixes.setdefault(int(match["layer"]), match["prefix"])
            if prefix != match["prefix"]:
                raise CheckpointError(f"layer {match['layer']} of {ckpt.model_dir} holds routed experts under two "
                                      f"names, {prefix} and {match['prefix']}")

    def pack(self, layer: int, reference: torch.nn.Module, options: dict) -> CpuExperts:
        """Layer `layer`'s experts packed with CpuExperts' options, shaped as `reference` (transformers' Experts
        module of that layer, on the meta device) says, with gpt-oss's biases and clamped SwiGLU."""
        prefix = self.prefixes.get(layer)
        if prefix is None:
            raise CheckpointError(f"{self.ckpt.model_dir} holds no routed experts of layer {layer}")
        layout = self.family.layout
        reference_parts = {part: getattr(reference, part) for part in layout.parts}
        expected = {part: tuple(t.shape) for part, t in reference_parts.items()}
        E, H, I = layout.dims(reference_parts)
        glu = layout.glu(reference, self.family.name)
        fused = {part: f"{prefix}.{part}" for part in layout.parts}
        quantized = [part for part, name in fused.items() if name + BLOCKS in self.ckpt.file_of]
        if quantized:
            parts = {part: self._read(name, expected[part]) for part, name in fused.items() if part not in quantized}
            codes = {part: self._read_mxfp4(fused[part], expected[part], layout) for part in quantized}
            experts_in_order = self._mxfp4_experts(codes, layout, E)
            biases = layout.biases(parts)
            names = [n for name in fused.values() for n in (name, name + BLOCKS, name + SCALES)
                     if n in self.ckpt.file_of]
        elif all(name in self.ckpt.file_of for name in fused.values()) or self.family.checkpoint_names is None:
            parts = {part: self._read(name, expected[part]) for part, name in fused.items()}
            experts_in_order = (layout.expert(parts, e) for e in range(E))
            biases, names = layout.biases(parts), list(fused.values())
        else:
            names = [f"{prefix}.{e}.{proj}.weight" for e in range(E) for proj in self.family.checkpoint_names]
            experts_in_order, biases = self._per_expert(names, (I, H), (H, I)), None
            names = names + [scale_name(name) for name in names if scale_name(name) in self.ckpt.file_of]
        try:
            experts = CpuExperts.from_experts(experts_in_order, E, **options)
        except HybridMoEError as e:  # the engine's refusals name an expert, not its layer
            raise type(e)(f"{prefix}: {e}") from None
        if biases is not None:
            experts.set_biases(*biases)
        if glu is not None:
            experts.set_glu(glu)
        for name in names:
            self.ckpt.release(name)
        return experts

    def _per_expert(self, names: list[str], gate_shape: tuple[int, int], down_shape: tuple[int, int]
                    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Each expert's (gate, up, down), read only when the engine asks for it; names: three per expert."""
        shapes = (gate_shape, gate_shape, down_shape)
        for first in range(0, len(names), 3):
            yield tuple(self._read_matrix(name, shape) for name, shape in zip(names[first:first + 3], shapes))

    def _mxfp4_experts(self, codes: dict[str, tuple[torch.Tensor, torch.Tensor]], layout: ExpertsLayout, E: int
                       ) -> Iterator[tuple[Mxfp4Codes, Mxfp4Codes, Mxfp4Codes]]:
        """Each expert's (gate, up, down) as Mxfp4Codes: views of the mapped blocks and scales, gate and up the rows
        of gate_up's W [2I, H] that the layout gives each."""
        if set(codes) != {"gate_up_proj", "down_proj"}:
            raise CheckpointError(f"{self.ckpt.model_dir} holds MXFP4 codes for {sorted(codes)} of a layer's experts; "
                                  "hybridmoe.hf reads layers whose gate_up_proj and down_proj are both MXFP4")
        (gate_up_blocks, gate_up_scales), (down_blocks, down_scales) = codes["gate_up_proj"], codes["down_proj"]
        for e in range(E):
            gate_up = gate_up_blocks[e].flatten(1), gate_up_scales[e]
            (gate_codes, up_codes), (gate_scales, up_scales) = (layout.gate_and_up(t, dim=0) for t in gate_up)
            yield (Mxfp4Codes(gate_codes, gate_scales, self.dtype), Mxfp4Codes(up_codes, up_scales, self.dtype),
                   Mxfp4Codes(down_blocks[e].flatten(1), down_scales[e], self.dtype))

    def _read_mxfp4(self, name: str, shape: tuple[int, ...], layout: ExpertsLayout
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused part `name`'s MXFP4 blocks [E, out, G, 16] and scales [E, out, G], views of the mapped file,
        checked against the float part's shape (W [out, in = G * 32] per expert, stored transposed where the layout
        is)."""
        blocks, scales = (self._get(name + suffix) for suffix in (BLOCKS, SCALES))
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
            raise CheckpointError(f"MXFP4 tensors {name}{BLOCKS} and {name}{SCALES} are {blocks.dtype} and "
                                  f"{scales.dtype}, expected uint8")
        if blocks.dim() != 4 or blocks.shape[-1] != MXFP4_BLOCK // 2 or scales.shape != blocks.shape[:-1]:
            raise CheckpointError(f"MXFP4 tensors {name}{BLOCKS} {list(blocks.shape)} and {name}{SCALES} "
                                  f"{list(scales.shape)} do not fit [E, out, G, {MXFP4_BLOCK // 2}] and [E, out, G]")
        E, out, groups, _ = blocks.shape
        dense = (E, groups * MXFP4_BLOCK, out) if layout.transposed else (E, out, groups * MXFP4_BLOCK)
        if dense != tuple(shape):
            raise CheckpointError(f"MXFP4 tensor {name}{BLOCKS} holds {list(dense)} weights, expected {list(shape)}")
        return blocks, scales

    def _read(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A fused part in the model's dtype (fused block-FP8 experts are no released layout: refused)."""
        tensor = self._read_matrix(name, shape)
        if isinstance(tensor, Fp8Codes):
            raise CheckpointError(f"{self.ckpt.model_dir} holds the fused experts tensor {name} in block FP8; "
                                  "hybridmoe.hf reads block-FP8 experts one tensor per expert, as DeepSeek ships them")
        return tensor

    def _read_matrix(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | Fp8Codes:
        """The tensor in the model's dtype, or where it is block-FP8 (float8_e4m3fn, its weight_scale_inv beside
        it) its codes and scales as they are."""
        if name not in self.ckpt.file_of:
            raise CheckpointError(f"{self.ckpt.model_dir} is missing tensor {name}")
        if self.ckpt.shape(name) != tuple(shape):
            raise CheckpointError(f"tensor {name} has shape {list(self.ckpt.shape(name))}, expected {list(shape)}")
        codes = self.ckpt.fp8_codes(name)
        if codes is None:
            return self._get(name).to(self.dtype)
        return Fp8Codes(*codes, self.dtype)

    def _get(self, name: str) -> torch.Tensor:
        if name not in self.ckpt.file_of:
            raise CheckpointError(f"{self.ckpt.model_dir} is missing tensor {name}")
        return self.ckpt.get(name)
