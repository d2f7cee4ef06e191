"""Mixtral (8x7B, 8x22B): GQA attention with rotary, every layer a sparse MoE of 8 experts.

The router keeps the top 2 of a softmax over all experts and rescales them to sum to 1.
Checkpoints name the MoE block `block_sparse_moe` and an expert's projections w1 (gate),
w3 (up), w2 (down).
"""

from __future__ import annotations

import re

from torch import nn

from hybridmoe.layers.attention import Attention
from hybridmoe.models.base import DecoderLayer, MoECausalLM
from hybridmoe.models.moe_block import SparseMoeBlock


class MixtralForCausalLM(MoECausalLM):
    config_defaults = {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None, "hidden_act": "silu",
        "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "sliding_window": None, "num_experts_per_tok": 2, "num_local_experts": 8,
    }
    config_aliases = {"num_experts": "num_local_experts"}
    default_rope_theta = 1e6

    expert_pattern = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight")
    expert_projs = {"w1": "gate", "w3": "up", "w2": "down"}
    expert_name_format = "model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.weight"

    def is_moe_layer(self, layer_idx: int) -> bool:
        return True

    def expert_dims(self) -> tuple[int, int]:
        return self.config.num_local_experts, self.config.intermediate_size

    def make_layer(self, layer_idx: int) -> nn.Module:
        c = self.config
        attn = Attention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                         c.rope_parameters, sliding_window=c.sliding_window)
        moe = SparseMoeBlock(layer_idx, c.hidden_size, c.num_local_experts, c.num_experts_per_tok,
                             renormalize=True, experts=self.experts)
        return DecoderLayer(attn, moe, c.hidden_size, c.rms_norm_eps, mlp_name="block_sparse_moe")
