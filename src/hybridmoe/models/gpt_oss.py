"""gpt-oss (GptOssForCausalLM: gpt-oss-20b, gpt-oss-120b).

Every layer: grouped-query attention with q/k/v and o biases (attention_bias), a learned sink logit per head in
each softmax (layers/sink_attention.py), rotary with YaRN (transformers' default for gpt-oss: factor 32 over an
original 4096 positions, truncate false), and a window of sliding_window positions on the layers layer_types
marks "sliding_attention" (by default the even-indexed ones; the others see the whole context). Then a MoE of
num_local_experts experts and no shared expert: the router is a linear layer with a bias whose top
num_experts_per_tok logits are softmaxed among themselves; each expert's projections have biases and it
applies the clamped SwiGLU (layers/clamped_swiglu.py), which the config declares (expert_glu, expert_bias) for the
expert backend: the torch reference, the native CPU engine and the hybrid GPU/CPU split run them
(experts/factory.py).

Checkpoints store a layer's experts fused: mlp.experts.gate_up_proj [E, H, 2I] with gate and up interleaved
column by column (gate = [..., ::2], up = [..., 1::2]), down_proj [E, I, H], and their biases [E, 2I], [E, H].
The released checkpoints quantize gate_up_proj and down_proj to MXFP4 (quantization_config quant_method "mxfp4",
X_blocks/X_scales), which weights/mxfp4.py decodes expert by expert into these float layouts; a float (bf16)
checkpoint loads as it is.

T tokens, H hidden, E experts, K experts per token, I expert intermediate size.
"""

from __future__ import annotations

import re

import torch
from torch import nn

import hybridmoe.layers.yarn  # noqa: F401  (registers rope_type "yarn", gpt-oss's rotary)
from hybridmoe.experts.base import ExpertBackend
from hybridmoe.layers.attention import Attention
from hybridmoe.layers.clamped_swiglu import ClampedSwiGLU
from hybridmoe.layers.router import topk_softmax
from hybridmoe.models.base import DecoderLayer, MoECausalLM

DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
"""transformers' GptOssConfig rotary when config.json names none."""


class GptOssMoeBlock(nn.Module):
    """The router and the routed experts, which the ExpertBackend holds and runs."""

    def __init__(self, layer_idx: int, hidden_size: int, num_experts: int, top_k: int, experts: ExpertBackend):
        super().__init__()
        self.layer_idx, self.top_k, self.experts = layer_idx, top_k, experts
        self.router = nn.Linear(hidden_size, num_experts, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]: the K best router logits, softmaxed among themselves, weigh their experts."""
        weights, ids = topk_softmax(self.router(x), self.top_k)
        return self.experts.forward(self.layer_idx, x, ids, weights)


class GptOssForCausalLM(MoECausalLM):
    config_defaults = {
        "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "hidden_act": "silu",
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "sliding_window": 128, "num_local_experts": 128, "num_experts_per_tok": 4, "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0, "attention_bias": True, "layer_types": None,
    }
    config_aliases = {"num_experts": "num_local_experts"}
    default_rope_theta = 150000.0

    fused_expert_pattern = re.compile(
        r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)")
    fused_expert_name_format = "model.layers.{layer}.mlp.experts.{part}"
    mxfp4_experts = True

    @classmethod
    def config_values(cls, raw: dict) -> dict:
        """transformers' YaRN default when config.json has neither rope_parameters nor rope_scaling."""
        values = super().config_values(raw)
        if not values.get("rope_parameters") and not values.get("rope_scaling"):
            values["rope_parameters"] = dict(DEFAULT_ROPE)
        return values

    @classmethod
    def finalize_config(cls, values: dict) -> None:
        """layer_types: transformers' default alternation (even-indexed layers slide); the experts' activation
        and biases declared for the expert backend (expert_glu, expert_bias)."""
        if values["layer_types"] is None:
            values["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                     for i in range(values["num_hidden_layers"])]
        values["expert_glu"] = ClampedSwiGLU(alpha=values["swiglu_alpha"], limit=values["swiglu_limit"])
        values["expert_bias"] = True

    def is_moe_layer(self, layer_idx: int) -> bool:
        return True

    def expert_dims(self) -> tuple[int, int]:
        return self.config.num_local_experts, self.config.intermediate_size

    def fused_expert_shapes(self) -> dict[str, tuple[int, ...]]:
        E, inter = self.expert_dims()
        H = self.config.hidden_size
        return {"gate_up_proj": (E, H, 2 * inter), "gate_up_proj_bias": (E, 2 * inter),
                "down_proj": (E, inter, H), "down_proj_bias": (E, H)}

    def split_fused_experts(self, parts: dict[str, torch.Tensor]) -> tuple[tuple, tuple | None]:
        """n experts' parts (the loader's: one expert, n = 1): gate_up [n, H, 2I] (gate and up interleaved by
        column) -> gate, up [n, I, H]; down [n, I, H] -> [n, H, I]; the gate_up bias [n, 2I] -> gate, up [n, I]; the
        down bias [n, H] as it is. Only slices of the last (out) dimension and transposes: MXFP4 codes and scales laid
        out as a part along it (weights/mxfp4.py Mxfp4Experts.codes) split the same way."""
        gate_up, bias = parts["gate_up_proj"], parts["gate_up_proj_bias"]
        weights = (gate_up[..., ::2].transpose(1, 2), gate_up[..., 1::2].transpose(1, 2),
                   parts["down_proj"].transpose(1, 2))
        return weights, (bias[:, ::2], bias[:, 1::2], parts["down_proj_bias"])

    def make_layer(self, layer_idx: int) -> nn.Module:
        c = self.config
        window = (c.sliding_window or None) if c.layer_types[layer_idx] == "sliding_attention" else None
        attn = Attention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                         c.rope_parameters, qkv_bias=c.attention_bias, o_bias=c.attention_bias,
                         sliding_window=window, sinks=True)
        moe = GptOssMoeBlock(layer_idx, c.hidden_size, c.num_local_experts, c.num_experts_per_tok, self.experts)
        return DecoderLayer(attn, moe, c.hidden_size, c.rms_norm_eps)
