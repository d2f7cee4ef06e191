"""Multi-head latent attention equals transformers' DeepSeek V2/V3 attention, cache included.

T tokens, H hidden. Our MLA attends over the cached latent (kv_b_proj absorbed); transformers
expands keys and values. Both are fed the same weights and compared in float32.
"""

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

from hybridmoe.forward_context import Context, use_context
from hybridmoe.layers import mla as mla_module
from hybridmoe.layers.mla import MultiHeadLatentAttention
from hybridmoe.layers.yarn import complete_yarn
from hybridmoe.models.base import normalize_rope

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
                                    complete_yarn(normalize_rope(cfg.to_dict(), 10000.0), cfg.max_position_embeddings), rope_interleave)
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
    ours.allocate_kv_cache(num_blocks=4, block_size=4)
    table = torch.tensor([[2, 0, 3, 1]], dtype=torch.int32)  # positions 0-3 in block 2, 4-7 in block 0, ...
    with use_context(Context(slot_ids=[0], start_pos=[0], cu_seqlens=[0, 11], block_table=table)):
        got = ours(x, torch.arange(11))
    torch.testing.assert_close(got, hf_attention(hf, hf_rotary, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family,q_lora_rank,rope,rope_interleave", CASES[1:3])
@torch.inference_mode()
@pytest.mark.parametrize("score_elements", [None, 1])  # 1: every query in a slice of its own
def test_batched_chunks_and_decode_through_the_latent_cache_match_full_recomputation(
        family, q_lora_rank, rope, rope_interleave, score_elements, monkeypatch):
    if score_elements is not None:
        monkeypatch.setattr(mla_module, "SCORE_ELEMENTS", score_elements)
    hf, hf_rotary, ours = build(family, q_lora_rank, rope, rope_interleave)
    a, b = torch.randn(9, 48), torch.randn(6, 48)
    ours.allocate_kv_cache(num_blocks=13, block_size=4)
    # three slots of four blocks each, in no order (block 0 unused, as the engine's scratch block)
    table = (torch.randperm(12, generator=torch.Generator().manual_seed(0)) + 1).to(torch.int32).view(3, 4)
    # a lives in slot 2, b in slot 0; steps: prefill chunks, a chunk beside a decode, pure decode
    steps = [([0, 0], [6, 4]), ([6, 4], [2, 1]), ([8, 5], [1, 1])]
    outs_a, outs_b = [], []
    for start, n in steps:
        x = torch.cat((a[start[0]:start[0] + n[0]], b[start[1]:start[1] + n[1]]))
        positions = torch.cat((torch.arange(n[0]) + start[0], torch.arange(n[1]) + start[1]))
        with use_context(Context(slot_ids=[2, 0], start_pos=start, cu_seqlens=[0, n[0], n[0] + n[1]],
                                 block_table=table)):
            out = ours(x, positions)
        outs_a.append(out[:n[0]])
        outs_b.append(out[n[0]:])
    torch.testing.assert_close(torch.cat(outs_a), hf_attention(hf, hf_rotary, a), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(outs_b), hf_attention(hf, hf_rotary, b), rtol=1e-5, atol=1e-5)
    # the cache holds R + P numbers per token, not expanded keys and values
    assert ours.kv_cache.shape == (13, 4, 16 + 8)
