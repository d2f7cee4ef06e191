"""gpt-oss's routed experts in a GGUF file, shown as the fused tensors of its Hugging Face checkpoints.

llama.cpp's converter splits a gpt-oss layer's mlp.experts.gate_up_proj [E, H, 2I] (gate and up interleaved
column by column) into blk.N.ffn_gate_exps and ffn_up_exps [E, I, H], transposes down_proj [E, I, H] into
ffn_down_exps [E, H, I], and splits gate_up_proj_bias [E, 2I] the same way into ffn_gate_exps.bias and
ffn_up_exps.bias [E, I] (ffn_down_exps.bias [E, H] is down_proj_bias). GptOssForCausalLM declares the fused parts
(models/gpt_oss.py), so here a layer's six tensors are named as its four parts again: gate_up_proj and
gate_up_proj_bias interleaved back, down_proj transposed back, down_proj_bias as it is. A part's experts are
read one at a time (PartExperts[e]), so a load holds one expert in float, whatever type the file stores
(F32, BF16, Q8_0, MXFP4, ...).

E experts, H hidden, I expert intermediate size.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch

from hybridmoe.errors import CheckpointError

PART_SOURCES = {"gate_up_proj": (("ffn_gate_exps", "weight"), ("ffn_up_exps", "weight")),
                "gate_up_proj_bias": (("ffn_gate_exps", "bias"), ("ffn_up_exps", "bias")),
                "down_proj": (("ffn_down_exps", "weight"),), "down_proj_bias": (("ffn_down_exps", "bias"),)}
"""Each fused part -> the GGUF tensors (blk.N.<tensor>.<kind>) it is made of, in order."""

HF_NAME = "model.layers.{layer}.mlp.experts.{part}"
_SOURCE = re.compile(r"blk\.(\d+)\.(ffn_gate_exps|ffn_up_exps|ffn_down_exps)\.(weight|bias)")


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [I, ...] -> [2I, ...] with gate's rows at even indices and up's at odd ones."""
    return torch.stack((gate, up), dim=1).flatten(0, 1)


_JOIN: dict[str, Callable[..., torch.Tensor]] = {
    "gate_up_proj": lambda gate, up: _interleave(gate, up).t(),  # [I, H] each -> [H, 2I]
    "gate_up_proj_bias": _interleave,  # [I] each -> [2I]
    "down_proj": lambda down: down.t(),  # [H, I] -> [I, H]
    "down_proj_bias": lambda bias: bias,
}
"""One expert's source tensors -> its slice of the fused part."""


class PartExperts:
    """One fused part of one layer; indexing reads one expert's source tensors and joins them."""

    def __init__(self, part: str, sources: tuple[str, ...], experts: int,
                 read: Callable[[str, int], torch.Tensor]):
        self.part, self.sources, self.experts, self.read = part, sources, experts, read

    def __len__(self) -> int:
        return self.experts

    def __getitem__(self, expert: int) -> torch.Tensor:
        return _JOIN[self.part](*(self.read(name, expert) for name in self.sources))


class GptOssExpertParts:
    """Every gpt-oss expert tensor of a GGUF file, grouped into the fused parts of its layers.

    shapes: GGUF name -> torch shape of every tensor of the file; read(GGUF name, expert) -> that expert's slice of
    the tensor in float32. A part one of whose sources is missing, or whose gate and up differ in shape, fails
    when the checkpoint opens, naming the GGUF tensors."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], read: Callable[[str, int], torch.Tensor], path: Path):
        self.shapes, self.read = shapes, read
        self.parts: dict[str, tuple[str, tuple[str, ...]]] = {}  # HF name -> (part, GGUF source names)
        layers = sorted({int(m.group(1)) for n in shapes if (m := _SOURCE.fullmatch(n))})
        for layer in layers:
            for part, sources in PART_SOURCES.items():
                names = tuple(f"blk.{layer}.{tensor}.{kind}" for tensor, kind in sources)
                present = [n for n in names if n in shapes]
                if not present:
                    continue  # the loader names the whole part as missing
                if len(present) < len(names):
                    missing = next(n for n in names if n not in shapes)
                    raise CheckpointError(f"{path} has {present[0]} without {missing}; the file is incomplete")
                if len({shapes[n] for n in names}) > 1:
                    raise CheckpointError(f"{path}: GGUF tensors {' and '.join(names)} differ in shape "
                                          f"({', '.join(str(list(shapes[n])) for n in names)})")
                self.parts[HF_NAME.format(layer=layer, part=part)] = (part, names)

    @staticmethod
    def takes(gguf_name: str) -> bool:
        """Whether gguf_name is one of the tensors the fused parts are made of."""
        return _SOURCE.fullmatch(gguf_name) is not None

    def shape(self, name: str) -> tuple[int, ...]:
        """The fused part's checkpoint shape: gate_up_proj [E, H, 2I], gate_up_proj_bias [E, 2I], down_proj
        [E, I, H], down_proj_bias [E, H]."""
        part, sources = self.parts[name]
        experts, *rest = self.shapes[sources[0]]
        if part == "gate_up_proj":
            return experts, rest[1], 2 * rest[0]
        if part == "gate_up_proj_bias":
            return experts, 2 * rest[0]
        return (experts, *reversed(rest))

    def experts(self, name: str) -> PartExperts:
        part, sources = self.parts[name]
        return PartExperts(part, sources, self.shapes[sources[0]][0], self.read)

    def get(self, name: str) -> torch.Tensor:
        """The whole fused part in float32 (the loader reads experts one at a time, experts(name))."""
        experts = self.experts(name)
        return torch.stack([experts[e] for e in range(len(experts))])

    def sources(self, name: str) -> tuple[str, ...]:
        return self.parts[name][1]
