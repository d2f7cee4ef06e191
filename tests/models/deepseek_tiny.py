"""Tiny random DeepSeek models of transformers' own classes, for the deepseek model tests.

Weights are redrawn at O(1) scale (transformers' 0.02 init leaves every layer close to the
identity, which would hide mistakes), including a nonzero e_score_correction_bias.
"""

import torch
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
)

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.9, "mscale_all_dim": 0.707}

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=2,
            num_experts_per_tok=3, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=16,
            first_k_dense_replace=1, max_position_embeddings=64, rope_parameters=YARN)

FAMILIES = {"v2": (DeepseekV2Config, DeepseekV2ForCausalLM), "v3": (DeepseekV3Config, DeepseekV3ForCausalLM)}


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            t.copy_(torch.randn(t.shape, generator=gen) * 0.3)
        elif name.endswith("norm.weight"):
            t.copy_(1 + 0.2 * torch.randn(t.shape, generator=gen))
        elif t.dim() >= 2:
            t.copy_(torch.randn(t.shape, generator=gen) * t.shape[-1] ** -0.5)


def tiny_deepseek(family: str, **overrides):
    """A random float32 transformers DeepseekV2/V3ForCausalLM (eval mode) of the TINY shape."""
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(0)
    hf = model_cls(config_cls(**{**TINY, **overrides})).float().eval()
    randomize(hf)
    return hf
