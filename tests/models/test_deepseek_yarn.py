"""YaRN frequencies, cos/sin factor and softmax scale equal transformers' for DeepSeek configs."""

import math

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v2.modeling_deepseek_v2 import yarn_apply_mscale

from hybridmoe.layers.yarn import complete_yarn, softmax_scale, yarn_rope
from hybridmoe.models.base import normalize_rope

# (factor, mscale, mscale_all_dim): the released checkpoints (equal mscales), unequal ones,
# and the two cases where transformers falls back to plain YaRN's 0.1 ln(factor) + 1
YARN_CASES = [(40.0, 1.0, 1.0), (4.0, 1.0, 0.707), (8.0, None, None), (16.0, 0.5, 0)]


def hf_config(factor, mscale, mscale_all_dim):
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": factor, "original_max_position_embeddings": 64,
            "beta_fast": 32, "beta_slow": 1}
    if mscale is not None:
        rope.update(mscale=mscale, mscale_all_dim=mscale_all_dim)
    return DeepseekV3Config(num_attention_heads=4, hidden_size=64, qk_rope_head_dim=16, qk_nope_head_dim=8,
                            max_position_embeddings=64 * int(factor), rope_parameters=rope)


@pytest.mark.parametrize("factor,mscale,mscale_all_dim", YARN_CASES)
def test_yarn_frequencies_and_scales_match_transformers(factor, mscale, mscale_all_dim):
    cfg = hf_config(factor, mscale, mscale_all_dim)
    rope = complete_yarn(normalize_rope(cfg.to_dict(), 10000.0), cfg.max_position_embeddings)
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    inv_freq, cos_sin_factor = yarn_rope(rope, cfg.qk_rope_head_dim)
    torch.testing.assert_close(inv_freq, hf_inv_freq, rtol=0, atol=0)
    assert cos_sin_factor == pytest.approx(hf_factor, rel=1e-12)
    assert softmax_scale(rope, cfg.qk_head_dim) == pytest.approx(
        yarn_apply_mscale(cfg.rope_parameters, cfg.qk_head_dim ** -0.5), rel=1e-12)


def test_yarn_without_factor_or_original_context_is_completed_like_transformers():
    rope = complete_yarn({"rope_type": "yarn", "rope_theta": 10000.0}, max_position_embeddings=4096)
    assert rope["original_max_position_embeddings"] == 4096 and rope["factor"] == 1.0
    rope = complete_yarn({"rope_type": "yarn", "rope_theta": 10000.0, "original_max_position_embeddings": 1024},
                         max_position_embeddings=4096)
    assert rope["factor"] == 4.0


def test_released_deepseek_v3_rope_scaling_gives_its_softmax_scale():
    # DeepSeek-V3's config.json: "rope_scaling": {"type": "yarn", ...} beside a top-level rope_theta
    original = {"rope_theta": 10000.0, "max_position_embeddings": 163840,
                "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                 "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}
    rope = complete_yarn(normalize_rope(original, 10000.0), 163840)
    _, cos_sin_factor = yarn_rope(rope, 64)
    assert cos_sin_factor == 1.0
    assert softmax_scale(rope, 192) == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2, rel=1e-12)


def test_plain_rope_keeps_the_plain_softmax_scale():
    assert softmax_scale({"rope_type": "default", "rope_theta": 5000.0}, 192) == 192 ** -0.5
