"""DeepSeek-V3.2 (DeepseekV32ForCausalLM): DeepSeek-V3 with DeepSeek Sparse Attention.

Every layer's MLA attends, per query, only to the index_topk cached positions its lightning indexer scores best
(layers/sparse_mla.py, layers/mla_indexer.py); the indexer keeps an index-key cache beside the latent one, which
kv_bytes_per_token counts. Routing, MLPs and YaRN are V3's (models/deepseek.py). As in transformers'
DeepseekV32, the q latent is always compressed (q_lora_rank: the indexer's queries read it), the MLA rotary
pairs are always interleaved, and mlp_layer_types, where config.json gives it, says which layers are MoE.
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from hybridmoe.errors import CheckpointError
from hybridmoe.layers.sparse_mla import SparseLatentAttention
from hybridmoe.models.deepseek import DeepseekV3ForCausalLM


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    # transformers' DeepseekV32Config defaults (5.25)
    config_defaults: ClassVar[dict] = {
        **DeepseekV3ForCausalLM.config_defaults,
        "max_position_embeddings": 163840, "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64,
        "mlp_layer_types": None,
    }

    @classmethod
    def finalize_config(cls, values: dict) -> None:
        super().finalize_config(values)
        kinds, layers = values.get("mlp_layer_types"), values["num_hidden_layers"]
        if kinds is not None and (not isinstance(kinds, list) or len(kinds) != layers
                                  or not set(kinds) <= {"dense", "sparse"}):
            raise CheckpointError(f"mlp_layer_types must list 'dense' or 'sparse' for each of the {layers} layers")
        if values.get("q_lora_rank") is None:
            raise CheckpointError("DeepSeek-V3.2 needs q_lora_rank: its indexer's queries read the q latent")
        if values["index_head_dim"] < values["qk_rope_head_dim"]:
            raise CheckpointError(f"index_head_dim {values['index_head_dim']} is below qk_rope_head_dim "
                                  f"{values['qk_rope_head_dim']}: the indexer's rotary turns that many dimensions")

    def is_moe_layer(self, layer_idx: int) -> bool:
        kinds = self.config.mlp_layer_types
        if kinds is None:
            return super().is_moe_layer(layer_idx)
        return bool(self.config.n_routed_experts) and kinds[layer_idx] == "sparse"

    def rope_interleave(self) -> bool:
        return True

    def make_attention(self) -> nn.Module:
        c = self.config
        return SparseLatentAttention(c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank,
                                     c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.rope_parameters,
                                     c.index_n_heads, c.index_head_dim, c.index_topk, c.attention_bias)
