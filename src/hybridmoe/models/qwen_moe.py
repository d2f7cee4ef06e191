"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B) and Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B).

Both: GQA attention with rotary, softmax top-k routing (renormalized if norm_topk_prob),
dense MLP layers where mlp_only_layers or decoder_sparse_step say so.
Qwen2: q/k/v bias, one shared expert per MoE layer scaled by sigmoid(shared_expert_gate x).
Qwen3: per-head RMSNorm of q and k (q_norm, k_norm), no shared expert.

T tokens, H hidden.
"""

from __future__ import annotations

import torch
from torch import nn

import hybridmoe.layers.yarn  # noqa: F401  (registers rope_type "yarn", which Qwen3's long-context configs use)
from hybridmoe.experts.base import ExpertBackend
from hybridmoe.layers.attention import Attention
from hybridmoe.layers.mlp import GatedMLP
from hybridmoe.models.base import DecoderLayer, MoECausalLM
from hybridmoe.models.moe_block import SparseMoeBlock

_COMMON_DEFAULTS = {
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "decoder_sparse_step": 1,
    "norm_topk_prob": False,
    "mlp_only_layers": None,
}


class Qwen2MoeSparseMoeBlock(SparseMoeBlock):
    """Routed experts plus the always-on shared expert, gated per token by a sigmoid."""

    def __init__(self, layer_idx: int, config, experts: ExpertBackend):
        c = config
        super().__init__(layer_idx, c.hidden_size, c.num_experts, c.num_experts_per_tok, c.norm_topk_prob, experts)
        self.shared_expert = GatedMLP(c.hidden_size, c.shared_expert_intermediate_size, c.hidden_act)
        self.shared_expert_gate = nn.Linear(c.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor, logits: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H] (residual + that, if given: the shared expert joins the routed ones first);
        logits: the router's gate(x) [T, E] if already made."""
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        out = super().forward(x, logits) + shared
        return out if residual is None else residual + out


class _QwenMoeForCausalLM(MoECausalLM):
    def __init__(self, config, experts: ExpertBackend | None):
        super().__init__(config, experts)
        if experts is not None:  # None: convert's probe model, which never runs
            self._hand_prefetch_targets(experts)

    def _hand_prefetch_targets(self, experts: ExpertBackend) -> None:
        """For each MoE layer, the weights the next layer's decode GEMVs read first (qkv, o_proj, and its router
        if it has one), for the backend's L2 prefetch while the layer's CPU experts run (prefetch_during)."""
        layers = self.model.layers
        for i in range(len(layers) - 1):
            if self.is_moe_layer(i):
                nxt = layers[i + 1]
                gate = getattr(nxt.mlp, "gate", None)
                experts.prefetch_during(i, [nxt.self_attn.qkv_proj, nxt.self_attn.o_proj]
                                        + ([gate] if isinstance(gate, nn.Linear) else []))

    def is_moe_layer(self, layer_idx: int) -> bool:
        c = self.config
        return (layer_idx not in c.mlp_only_layers and c.num_experts > 0
                and (layer_idx + 1) % c.decoder_sparse_step == 0)

    def expert_dims(self) -> tuple[int, int]:
        return self.config.num_experts, self.config.moe_intermediate_size

    def make_layer(self, layer_idx: int) -> nn.Module:
        c = self.config
        attn = self.make_attention(layer_idx)
        if self.is_moe_layer(layer_idx):
            mlp = self.make_moe(layer_idx)
        else:
            mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act)
        return DecoderLayer(attn, mlp, c.hidden_size, c.rms_norm_eps)


class Qwen2MoeForCausalLM(_QwenMoeForCausalLM):
    config_defaults = {
        **_COMMON_DEFAULTS,
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
        "num_attention_heads": 16, "num_key_value_heads": 16, "max_window_layers": 28,
        "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
        "num_experts_per_tok": 4, "num_experts": 60, "qkv_bias": True, "layer_types": None,
    }

    @classmethod
    def finalize_config(cls, values: dict) -> None:
        values["mlp_only_layers"] = values["mlp_only_layers"] or []
        if values["layer_types"] is None:
            # transformers' rule: with use_sliding_window, even-indexed layers below max_window_layers slide.
            values["layer_types"] = [
                "sliding_attention" if (i + 1) % 2 and i < values["max_window_layers"] and values["use_sliding_window"]
                else "full_attention" for i in range(values["num_hidden_layers"])]

    def make_attention(self, layer_idx: int) -> Attention:
        c = self.config
        window = c.sliding_window if c.layer_types[layer_idx] == "sliding_attention" else None
        return Attention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                         c.rope_parameters, qkv_bias=c.qkv_bias, sliding_window=window)

    def make_moe(self, layer_idx: int) -> nn.Module:
        return Qwen2MoeSparseMoeBlock(layer_idx, self.config, self.experts)


class Qwen3MoeForCausalLM(_QwenMoeForCausalLM):
    config_defaults = {
        **_COMMON_DEFAULTS,
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
        "num_attention_heads": 32, "num_key_value_heads": 4, "attention_bias": False,
        "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_experts": 128,
    }
    config_aliases = {"num_local_experts": "num_experts"}

    @classmethod
    def finalize_config(cls, values: dict) -> None:
        values["mlp_only_layers"] = values["mlp_only_layers"] or []
        values["sliding_window"] = values["sliding_window"] if values["use_sliding_window"] else None

    def make_attention(self, layer_idx: int) -> Attention:
        c = self.config
        return Attention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                         c.rope_parameters, qkv_bias=c.attention_bias, o_bias=c.attention_bias,
                         qk_norm_eps=c.rms_norm_eps, sliding_window=c.sliding_window)

    def make_moe(self, layer_idx: int) -> nn.Module:
        c = self.config
        return SparseMoeBlock(layer_idx, c.hidden_size, c.num_experts, c.num_experts_per_tok,
                              c.norm_topk_prob, self.experts)
