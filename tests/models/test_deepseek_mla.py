"""Multi-head latent attention equals transformers' DeepSeek V2/V3 attention, cache included.

T tokens, H hidden. Our MLA attends over the cached latent (kv_b_proj absorbed); transformers
expands keys and values. Both are fed the same weights and compared in float32.
"""

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

from hybridmoe.engine.context import Context, use_context
from hybridmoe.layers.mla import MultiHeadLatentAttention
from hybridmoe.layers.yarn import rope_dict

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.9, "mscale_all_dim": 0.707}
SHAPES = dict(hidden_size=48, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
              v_head_dim=12, max_position_embeddings=64)

# (family, q_lora_rank, rope_parameters, rope_interleave)
CASES = [
    ("v2", None, None, True),
    ("v2", 24, YARN, True),
    ("v3", 24, YARN, True),
    ("v3", None, None, False),
]


def build(family, q_lora_rank, rope, rope_interleave):
    torch.manual_seed(0)
    if family == "v2":
        cfg = DeepseekV2Config(q_lora_rank=q_lora_rank, rope_parameters=rope, **SHAPES)
        hf, hf_rotary = hf_v2.DeepseekV2Attention(cfg, layer_idx=0), hf_v2.DeepseekV2RotaryEmbedding(cfg)
    else:
        cfg = DeepseekV3Config(q_lora_rank=q_lora_rank, rope_parameters=rope, rope_interleave=rope_interleave,
                               **SHAPES)
        hf, hf_rotary = hf_v3.DeepseekV3Attention(cfg, layer_idx=0), hf_v3.DeepseekV3RotaryEmbedding(cfg)
    cfg._attn_implementation = "eager"
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.3)
    ours = MultiHeadLatentAttention(cfg.hidden_size, cfg.num_attention_heads, q_lora_rank, cfg.kv_lora_rank,
                                    cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim,
                                    rope_dict(cfg.to_dict()), rope_interleave)
    missing = ours.load_state_dict(hf.state_dict(), strict=True)
    assert not missing.missing_keys
    return hf.eval(), hf_rotary, ours.eval()


def hf_attention(hf, hf_rotary, x):
    """Causal self-attention of one sequence x [T, H] -> [T, H]."""
    T = x.shape[0]
    positions = torch.arange(T)[None]
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    out, _ = hf(x[None], attention_mask=mask, position_embeddings=hf_rotary(x[None], positions))
    return out[0]


@pytest.mark.parametrize("family,q_lora_rank,rope,rope_interleave", CASES)
@torch.inference_mode()
def test_prefill_matches_transformers(family, q_lora_rank, rope, rope_interleave):
    hf, hf_rotary, ours = build(family, q_lora_rank, rope, rope_interleave)
    x = torch.randn(11, 48)
    ours.allocate_kv_cache(num_slots=1, max_len=16)
    with use_context(Context(slot_ids=[0], start_pos=[0], cu_seqlens=[0, 11])):
        got = ours(x, torch.arange(11))
    torch.testing.assert_close(got, hf_attention(hf, hf_rotary, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family,q_lora_rank,rope,rope_interleave", CASES[1:3])
@torch.inference_mode()
def test_batched_chunks_and_decode_through_the_latent_cache_match_full_recomputation(
        family, q_lora_rank, rope, rope_interleave):
    hf, hf_rotary, ours = build(family, q_lora_rank, rope, rope_interleave)
    a, b = torch.randn(9, 48), torch.randn(5, 48)
    ours.allocate_kv_cache(num_slots=3, max_len=16)
    # step 1: a[:6] into slot 2 and b[:4] into slot 0; step 2: a[6:] and b[4:] (prefill chunk + decode)
    with use_context(Context(slot_ids=[2, 0], start_pos=[0, 0], cu_seqlens=[0, 6, 10])):
        first = ours(torch.cat((a[:6], b[:4])), torch.cat((torch.arange(6), torch.arange(4))))
    with use_context(Context(slot_ids=[2, 0], start_pos=[6, 4], cu_seqlens=[0, 3, 4])):
        second = ours(torch.cat((a[6:], b[4:])), torch.tensor([6, 7, 8, 4]))
    want_a, want_b = hf_attention(hf, hf_rotary, a), hf_attention(hf, hf_rotary, b)
    torch.testing.assert_close(torch.cat((first[:6], second[:3])), want_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat((first[6:], second[3:])), want_b, rtol=1e-5, atol=1e-5)
    # the cache holds R + P numbers per token, not expanded keys and values
    assert ours.kv_cache.shape == (3, 16, 16 + 8)
