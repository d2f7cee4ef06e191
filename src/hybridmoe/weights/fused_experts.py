"""Routed experts stored fused: one checkpoint tensor per MoE layer and part, holding all its experts (gpt-oss:
mlp.experts.gate_up_proj [E, H, 2I], gate_up_proj_bias [E, 2I], down_proj [E, I, H], down_proj_bias [E, H]).

The model names the parts and their shapes (fused_expert_shapes) and splits parts into each expert's gate, up and
down and their biases (split_fused_experts, views). Once every part of a layer is listed, its experts are handed
to the backend one at a time (set_layer_experts, which copies or packs them): each part's slice of one expert is
read and checked, then split; then the biases (set_layer_biases), and the parts' mapped pages are released. A
checkpoint that stores parts quantized (weights/mxfp4.py) offers them through fused_experts(name), a sequence
that decodes one expert when indexed, so no layer is ever whole in float; a float part is its tensor. Where the
backend takes MXFP4 codes (takes_mxfp4_codes: the native mxfp4 format), an MXFP4 part is never decoded: each
expert's codes and scales go through the model's split as they are (it slices the out dimension, which the codes
keep: Mxfp4Experts.codes) and reach the backend as Mxfp4Codes.
"""

from __future__ import annotations

import torch

from hybridmoe.errors import CheckpointError
from hybridmoe.experts.mxfp4_codes import E8M0_HELD, Mxfp4Codes, unheld_scales
from hybridmoe.models.base import MoECausalLM
from hybridmoe.weights.mxfp4 import Mxfp4Experts


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
        self.mxfp4_codes = model.experts.takes_mxfp4_codes()

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
        """(gate [I, H], up [I, H], down [H, I]) of each expert in turn, in the expert dtype and device (or as
        Mxfp4Codes, where the backend takes them); its biases appended to `biases`."""
        coded = {part for part, p in parts.items() if self.mxfp4_codes and isinstance(p, Mxfp4Experts)}
        for e in range(num_experts):
            one = {part: self.checked(f"{names[part]} (expert {e})", parts[part][e]).unsqueeze(0)
                   for part in parts if part not in coded}
            if coded:
                weights, expert_biases = self._codes(names, parts, coded, one, e)
            else:
                (gate, up, down), expert_biases = self.model.split_fused_experts(one)
                weights = tuple(w[0].to(self.device, self.dtype) for w in (gate, up, down))
            biases.append(expert_biases)
            yield weights

    def _codes(self, names: dict[str, str], parts: dict, coded: set[str], floats: dict, e: int) -> tuple:
        """Expert e's (gate, up, down) and biases, its matrices from the MXFP4 parts `coded` as Mxfp4Codes: the
        model's split applied to the codes, then to the scales (each laid out as the float part along its out
        dimension), the float parts beside them."""
        for part in coded:
            blocks, scales = parts[part].blocks[e], parts[part].scales[e]  # [out, G, 16], [out, G]
            bad = unheld_scales(blocks.reshape(blocks.shape[0], -1), scales)
            if len(bad):
                row, block = bad[0].tolist()
                raise CheckpointError(
                    f"tensor {names[part]} (expert {e}) has e8m0 scale {int(scales[row, block])} at row {row}, block "
                    f"{block} under nonzero codes, outside {E8M0_HELD[0]}..{E8M0_HELD[1]} (the scales the native "
                    "mxfp4 format holds); the checkpoint file is damaged")
        views = {part: parts[part].codes(e) for part in coded}
        codes, expert_biases = self.model.split_fused_experts({**floats, **{p: v[0][None] for p, v in views.items()}})
        scales, _ = self.model.split_fused_experts({**floats, **{p: v[1][None] for p, v in views.items()}})
        weights = tuple(Mxfp4Codes(c[0].contiguous(), s[0].contiguous(), self.dtype) if c.dtype == torch.uint8
                        else c[0].to(self.device, self.dtype) for c, s in zip(codes, scales))
        return weights, expert_biases

    def first_missing(self) -> str | None:
        for layer in sorted(self.layers - self.done):
            have = self.names.get(layer, {})
            for part in self.shapes:
                if part not in have:
                    return self.model.fused_expert_name_format.format(layer=layer, part=part)
        return None
