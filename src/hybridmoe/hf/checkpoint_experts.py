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
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from hybridmoe.errors import CheckpointError
from hybridmoe.experts.cpu_experts import CpuExperts
from hybridmoe.hf.family_layouts import Family
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
        if all(name in self.ckpt.file_of for name in fused.values()) or self.family.checkpoint_names is None:
            parts = {part: self._read(name, expected[part]) for part, name in fused.items()}
            experts_in_order = (layout.expert(parts, e) for e in range(E))
            biases, names = layout.biases(parts), list(fused.values())
        else:
            names = [f"{prefix}.{e}.{proj}.weight" for e in range(E) for proj in self.family.checkpoint_names]
            experts_in_order, biases = self._per_expert(names, (I, H), (H, I)), None
        experts = CpuExperts.from_experts(experts_in_order, E, **options)
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
            yield tuple(self._read(name, shape) for name, shape in zip(names[first:first + 3], shapes))

    def _read(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.ckpt.file_of:
            raise CheckpointError(f"{self.ckpt.model_dir} is missing tensor {name}")
        tensor = self.ckpt.get(name)
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(f"tensor {name} has shape {list(tensor.shape)}, expected {list(shape)}")
        return tensor.to(self.dtype)
