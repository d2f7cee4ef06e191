"""Routed experts stored fused: one checkpoint tensor per MoE layer and part, holding all its experts (gpt-oss:
mlp.experts.gate_up_proj [E, H, 2I], gate_up_proj_bias [E, 2I], down_proj [E, I, H], down_proj_bias [E, H]).

The model names the parts and their shapes (fused_expert_shapes) and splits parts into each expert's gate, up and
down and their biases (split_fused_experts, views). Once every part of a layer is listed, its experts are handed
to the backend one at a time (set_layer_experts, which copies or packs them): each part's slice of one expert is
read and checked, then split; then the biases (set_layer_biases), and the parts' mapped pages are released. A
checkpoint that stores parts quantized (weights/mxfp4.py) offers them through fused_experts(name), a sequence
that decodes one expert when indexed, so no layer is ever whole in float; a float part is its tensor.
"""

from __future__ import annotations

import torch

from hybridmoe.models.base import MoECausalLM


class FusedExpertLayers:
    """Collects where each fused part of a MoE layer is and hands complete layers to the model's backend."""

    def __init__(self, model: MoECausalLM, ckpt, device: torch.device, dtype: torch.dtype, checked):
        """checked(name, tensor): the loader's check of a tensor it reads (a float, finite)."""
        self.model, self.ckpt, self.device, self.dtype, self.checked = model, ckpt, device, dtype, checked
        fused = model.fused_expert_pattern is not None
        self.shapes = model.fused_expert_shapes() if fused else {}
        self.layers = set(model.moe_layers) if fused else set()
        self.names: dict[int, dict[str, str]] = {}  # layer -> part -> checkpoint name
        self.done: set[int] = set()

    def accepts(self, layer: int, part: str) -> bool:
        return layer in self.layers and part in self.shapes

    def expected_shape(self, part: str) -> tuple[int, ...]:
        return self.shapes[part]

    def add(self, layer: int, part: str, name: str) -> None:
        names = self.names.setdefault(layer, {})
        names[part] = name
        if len(names) == len(self.shapes):
            self._hand_over(layer, self.names.pop(layer))
            self.done.add(layer)

    def _hand_over(self, layer: int, names: dict[str, str]) -> None:
        read = getattr(self.ckpt, "fused_experts", self.ckpt.get)
        parts = {part: read(name) for part, name in names.items()}
        backend, num_experts = self.model.experts, self.model.expert_dims()[0]
        biases: list[tuple] = []  # each expert's (gate, up, down) biases [1, ...], as its weights are taken
        backend.set_layer_experts(layer, self._experts(names, parts, num_experts, biases), num_experts)
        if biases and biases[0] is not None:
            backend.set_layer_biases(layer, *(torch.cat(b).to(self.device, self.dtype) for b in zip(*biases)))
        release = getattr(self.ckpt, "release", lambda name: None)
        for name in names.values():
            release(name)

    def _experts(self, names: dict[str, str], parts: dict, num_experts: int, biases: list):
        """(gate [I, H], up [I, H], down [H, I]) of each expert in turn, in the expert dtype and device; its biases
        appended to `biases`."""
        for e in range(num_experts):
            one = {part: self.checked(f"{names[part]} (expert {e})", parts[part][e]).unsqueeze(0) for part in parts}
            (gate, up, down), expert_biases = self.model.split_fused_experts(one)
            biases.append(expert_biases)
            yield tuple(w[0].to(self.device, self.dtype) for w in (gate, up, down))

    def first_missing(self) -> str | None:
        for layer in sorted(self.layers - self.done):
            have = self.names.get(layer, {})
            for part in self.shapes:
                if part not in have:
                    return self.model.fused_expert_name_format.format(layer=layer, part=part)
        return None
