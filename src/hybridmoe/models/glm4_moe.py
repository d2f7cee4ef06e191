"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 (Glm4MoeForCausalLM).

Every layer: grouped-query attention with q/k/v bias when attention_bias (o_proj never has one),
per-head RMSNorm of q and k when use_qk_norm, and rotary over only the first
head_dim * partial_rotary_factor dimensions of each head (0.5 unless config.json says otherwise,
as in transformers). Then a dense gated MLP for the first first_k_dense_replace layers and, for
the rest, DeepSeek-V3's MoE: sigmoid routing with e_score_correction_bias within the topk_group
best of n_group groups (models/deepseek.py noaux_tc_router), plus n_shared_experts always-on
experts. Checkpoints ship a multi-token-prediction layer past num_hidden_layers, which is skipped.

T tokens, H hidden.
"""

from __future__ import annotations

from torch import nn

from hybridmoe.layers.attention import Attention
from hybridmoe.layers.deepseek_routing import DeepseekRouter
from hybridmoe.models.base import DecoderLayer, MoECausalLM, partial_rotary_dim
from hybridmoe.models.deepseek import (
    deepseek_mlp,
    is_beyond_last_layer,
    noaux_tc_router,
)

DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5
"""transformers' Glm4MoeConfig rotates half of each head when config.json names no factor."""


class Glm4MoeForCausalLM(MoECausalLM):
    config_defaults = {
        "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944, "num_hidden_layers": 46,
        "num_attention_heads": 96, "num_key_value_heads": 8, "hidden_act": "silu",
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "attention_bias": False, "moe_intermediate_size": 1408, "num_experts_per_tok": 8, "n_shared_experts": 1,
        "n_routed_experts": 128, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
        "first_k_dense_replace": 1, "norm_topk_prob": True, "use_qk_norm": False,
    }
    config_aliases = {"num_local_experts": "n_routed_experts"}

    @classmethod
    def finalize_config(cls, values: dict) -> None:
        """rotary_dim: the rotated dimensions of a head, from partial_rotary_factor (transformers 5 keeps it in
        rope_parameters, older config.json files at the top level)."""
        values["rotary_dim"] = partial_rotary_dim(values, DEFAULT_PARTIAL_ROTARY_FACTOR)

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.config.first_k_dense_replace

    def expert_dims(self) -> tuple[int, int]:
        return self.config.n_routed_experts, self.config.moe_intermediate_size

    def make_router(self) -> DeepseekRouter:
        return noaux_tc_router(self.config)

    def make_layer(self, layer_idx: int) -> nn.Module:
        c = self.config
        attn = Attention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                         c.rope_parameters, qkv_bias=c.attention_bias,
                         qk_norm_eps=c.rms_norm_eps if c.use_qk_norm else None, rotary_dim=c.rotary_dim)
        return DecoderLayer(attn, deepseek_mlp(self, layer_idx), c.hidden_size, c.rms_norm_eps)

    def is_ignored(self, name: str) -> bool:
        return is_beyond_last_layer(name, self.config.num_hidden_layers) or super().is_ignored(name)
