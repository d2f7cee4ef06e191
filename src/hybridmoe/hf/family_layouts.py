"""transformers 5's routed-expert modules, family by family: which class holds a MoE layer's experts, how its
tensors are laid out, and how one expert is read out of them for the native engine.

transformers 5 fuses a MoE layer's routed experts into one module (Qwen3MoeExperts, MixtralExperts, ...), which
its sparse block calls as experts(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H] once
the block's own router has chosen and weighted each token's experts. Two layouts cover the supported families
(E experts, H hidden, I expert intermediate size):

- STACKED (Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V2/V3, GLM-4.5, MiniMax-M2): gate_up_proj [E, 2I, H], the
  gate's I rows first and then the up's; down_proj [E, H, I]. An expert computes down (silu(gate x) * up x).
- GPT_OSS: gate_up_proj [E, H, 2I] with gate and up interleaved along 2I (gate the even columns, up the odd),
  gate_up_proj_bias [E, 2I] interleaved alike, down_proj [E, I, H] and down_proj_bias [E, H]; an expert computes
  h @ down + down bias with h the clamped SwiGLU (layers/clamped_swiglu.py, the module's alpha and limit) of
  x @ gate_up + gate_up bias.

Either layout gives each expert as the native engine packs it, gate [I, H], up [I, H], down [H, I], and the
biases as it takes them, gate and up [E, I], down [E, H]. A checkpoint keeps a layer's experts either as the
module's fused tensors, under its parameter names, or as one tensor per expert and projection,
{prefix}.experts.{e}.{name}.weight, with the family's names for gate, up and down (Family.checkpoint_names).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridmoe.errors import HybridMoEError
from hybridmoe.layers.clamped_swiglu import ClampedSwiGLU

_SILU_PROBE = torch.linspace(-8.0, 8.0, 33)
"""Inputs at which a module's expert activation must equal silu for the native engine to run it."""


@dataclass(frozen=True)
class ExpertsLayout:
    parts: tuple[str, ...]
    """The module's parameters, each fused over its E experts (the same names in a fused checkpoint)."""

    transposed: bool
    """Weights are [E, in, out] (x @ W) rather than [E, out, in] (W x)."""

    interleaved: bool
    """Gate and up alternate along 2I rather than stacking the gate's I first."""

    clamped_swiglu: bool
    """The experts' activation is the clamped SwiGLU with the module's alpha and limit, rather than silu."""

    def dims(self, parts: dict[str, torch.Tensor]) -> tuple[int, int, int]:
        """(E, H, I) of these fused tensors."""
        E, rows, cols = parts["down_proj"].shape
        return (E, cols, rows) if self.transposed else (E, rows, cols)

    def expert(self, parts: dict[str, torch.Tensor], e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert e's gate [I, H], up [I, H] and down [H, I]: views of the fused tensors, nothing copied."""
        gate_up, down = parts["gate_up_proj"][e], parts["down_proj"][e]
        if self.transposed:
            gate_up, down = gate_up.T, down.T
        gate, up = self.gate_and_up(gate_up, dim=0)
        return gate, up, down

    def biases(self, parts: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Gate and up biases [E, I] and down bias [E, H]; None where the layout has none."""
        if "gate_up_proj_bias" not in self.parts:
            return None
        gate, up = self.gate_and_up(parts["gate_up_proj_bias"], dim=1)
        return gate, up, parts["down_proj_bias"]

    def gate_and_up(self, t: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """t's 2I along dim as its gate half and its up half (views; t may be a layer's fused weight, bias, or one
        expert's MXFP4 codes or scales with its 2I rows along dim 0)."""
        if self.interleaved:
            gate, up = t.unflatten(dim, (-1, 2)).unbind(dim + 1)
        else:
            gate, up = t.unflatten(dim, (2, -1)).unbind(dim)
        return gate, up

    def glu(self, module: torch.nn.Module, family: str) -> ClampedSwiGLU | None:
        """The activation the native engine gives these experts: None for silu(gate) * up, else a ClampedSwiGLU.
        A STACKED module whose act_fn is not silu is an error: the engine runs nothing else."""
        if self.clamped_swiglu:
            return ClampedSwiGLU(alpha=float(module.alpha), limit=float(module.limit))
        act = getattr(module, "act_fn", None)
        if act is None or not torch.allclose(act(_SILU_PROBE), torch.nn.functional.silu(_SILU_PROBE)):
            raise HybridMoEError(f"the {family} experts' activation {type(act).__name__} is not silu; the native "
                                 "CPU expert engine runs silu experts (and gpt-oss's clamped SwiGLU) only")
        return None


STACKED = ExpertsLayout(parts=("gate_up_proj", "down_proj"), transposed=False, interleaved=False,
                        clamped_swiglu=False)
GPT_OSS = ExpertsLayout(parts=("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"), transposed=True,
                        interleaved=True, clamped_swiglu=True)

GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")
W1_W3_W2 = ("w1", "w3", "w2")


@dataclass(frozen=True)
class Family:
    name: str
    """What messages call it."""

    experts_class: str
    """transformers' class of one MoE layer's routed experts."""

    layout: ExpertsLayout

    checkpoint_names: tuple[str, str, str] | None
    """Gate, up and down in a checkpoint that keeps one tensor per expert (None: its checkpoints keep them fused)."""


FAMILIES = {
    "qwen2_moe": Family("Qwen2-MoE", "Qwen2MoeExperts", STACKED, GATE_UP_DOWN),
    "qwen3_moe": Family("Qwen3-MoE", "Qwen3MoeExperts", STACKED, GATE_UP_DOWN),
    "mixtral": Family("Mixtral", "MixtralExperts", STACKED, W1_W3_W2),
    "deepseek_v2": Family("DeepSeek-V2", "DeepseekV2Experts", STACKED, GATE_UP_DOWN),
    "deepseek_v3": Family("DeepSeek-V3", "DeepseekV3Experts", STACKED, GATE_UP_DOWN),
    "glm4_moe": Family("GLM-4.5", "Glm4MoeExperts", STACKED, GATE_UP_DOWN),
    "gpt_oss": Family("gpt-oss", "GptOssExperts", GPT_OSS, None),
    "minimax_m2": Family("MiniMax-M2", "MiniMaxM2Experts", STACKED, W1_W3_W2),
}
"""transformers' model_type -> its family."""


def family_of(config, what: str) -> Family:
    """The family of a model whose config this is; `what` names the model in the error for an unsupported one."""
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        supported = ", ".join(f.name for f in FAMILIES.values())
        raise HybridMoEError(f"hybridmoe.hf cannot offload the experts of {what} (model_type {model_type!r}); "
                             f"it supports {supported}")
    return family
