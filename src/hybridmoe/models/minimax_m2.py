"""MiniMax-M2 / M2.1 (MiniMaxM2ForCausalLM).

Every layer: grouped-query attention without biases, with one RMSNorm over all of q's heads together and one over all
of k's (q_norm [Hq D], k_norm [Hkv D], config.json's qk_norm_type "per_layer"), before the split into heads; rotary
over each head's first rotary_dim dimensions (64 of 128 in the release). Then, in every layer, a sparse MoE without
shared experts: sigmoid scores plus e_score_correction_bias choose the num_experts_per_tok experts, the unbiased
scores weigh them, renormalised to sum to 1, with no routed scaling (DeepSeek-V3's router in one group,
layers/deepseek_routing.py).

The rest is Mixtral's (as in transformers, whose MiniMaxM2 derives from Mixtral): num_local_experts experts of
intermediate_size, the block spelled `block_sparse_moe` and an expert's projections w1 (gate), w3 (up), w2 (down).
Checkpoints keep the correction bias on the block (block_sparse_moe.e_score_correction_bias), where ours is on its
router. Their multi-token-prediction modules (num_mtp_modules) sit past num_hidden_layers and are skipped.

T tokens, H hidden.
"""

from __future__ import annotations

from torch import nn

from hybridmoe.errors import CheckpointError
from hybridmoe.layers.attention import Attention
from hybridmoe.layers.deepseek_routing import DeepseekRouter
from hybridmoe.models.base import DecoderLayer
from hybridmoe.models.deepseek import DeepseekMoE, is_beyond_last_layer
from hybridmoe.models.mixtral import MixtralForCausalLM

_CHECKPOINT_BIAS = ".block_sparse_moe.e_score_correction_bias"
_ROUTER_BIAS = ".block_sparse_moe.gate.e_score_correction_bias"


class MiniMaxM2ForCausalLM(MixtralForCausalLM):
    config_defaults = {
        "vocab_size": 200064, "hidden_size": 3072, "intermediate_size": 1536, "num_hidden_layers": 62,
        "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
        "max_position_embeddings": 196608, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "num_experts_per_tok": 8, "num_local_experts": 256,
    }
    default_rope_theta = 5e6

    @classmethod
    def finalize_config(cls, values: dict) -> None:
        """rotary_dim: the rotated dimensions of a head, as transformers' MiniMaxM2Config finds them:
        partial_rotary_factor in rope_parameters, else at the top level, else the released config.json's
        rotary_dim / head_dim, else 1 (whole heads); then int(head_dim * factor)."""
        head_dim = values["head_dim"]
        factor = values["rope_parameters"].get("partial_rotary_factor")
        if factor is None:
            factor = values.get("partial_rotary_factor")
        if factor is None and values.get("rotary_dim") is not None:
            factor = values["rotary_dim"] / head_dim
        rotary_dim = int(head_dim * (1.0 if factor is None else factor))
        if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
            raise CheckpointError(f"head_dim {head_dim} with rotary_dim {values.get('rotary_dim')} / "
                                  f"partial_rotary_factor {factor} rotates {rotary_dim} dimensions; rotary needs an "
                                  f"even number from 2 to head_dim")
        values["rotary_dim"] = rotary_dim

    def make_layer(self, layer_idx: int) -> nn.Module:
        c = self.config
        attn = Attention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rope_parameters,
                         qk_norm_eps=c.rms_norm_eps, qk_norm_per_head=False, rotary_dim=c.rotary_dim)
        router = DeepseekRouter(c.hidden_size, c.num_local_experts, c.num_experts_per_tok, scoring_func="sigmoid",
                                topk_method="noaux_tc", norm_topk_prob=True)
        moe = DeepseekMoE(layer_idx, router, self.experts, c.hidden_size, 0, c.hidden_act)
        return DecoderLayer(attn, moe, c.hidden_size, c.rms_norm_eps, mlp_name="block_sparse_moe")

    def param_target(self, name: str) -> tuple[str, int | None]:
        if name.endswith(_CHECKPOINT_BIAS):
            return name.removesuffix(_CHECKPOINT_BIAS) + _ROUTER_BIAS, None
        return super().param_target(name)

    def checkpoint_name(self, param_name: str, shard: int | None) -> str:
        if param_name.endswith(_ROUTER_BIAS):
            return param_name.removesuffix(_ROUTER_BIAS) + _CHECKPOINT_BIAS
        return super().checkpoint_name(param_name, shard)

    def is_ignored(self, name: str) -> bool:
        return is_beyond_last_layer(name, self.config.num_hidden_layers) or super().is_ignored(name)
