"""Model shapes for `hybridmoe make-model`: config.json contents per architecture and preset.

Real-shape presets carry the fields and values of the public config.json of that model (minus
`auto_map`, and DeepSeek-V3's FP8 `quantization_config`: we write bf16/fp32 weights); glm-4.5-air carries
transformers' Glm4MoeConfig defaults, which are GLM-4.5-Air's shape; minimax-m2 carries MiniMaxAI/MiniMax-M2's
config.json (its shape is transformers' MiniMaxM2Config defaults); gpt-oss-20b and gpt-oss-120b carry
openai/gpt-oss-20b's and openai/gpt-oss-120b's config.json less their MXFP4 `quantization_config` (gpt-oss-120b's
shape, YaRN and window are also transformers' GptOssConfig defaults); kimi-k2 carries
moonshotai/Kimi-K2-Instruct's config.json less its FP8 `quantization_config` (transformers has no Kimi-K2 class); qwen3-next-80b-a3b carries Qwen/Qwen3-Next-80B-A3B-Instruct's config.json
less its layer_types list (the same layers follow from full_attention_interval 4); qwen3.5-35b-a3b carries
transformers' Qwen3_5MoeTextConfig defaults (the shape its docstring names Qwen/Qwen3.5-35B-A3B's); kimi-k2.5
carries moonshotai/Kimi-K2.5's multimodal config.json less its int4 `quantization_config` (its comment says which
values are verified), the text model's config nested under text_config. Token ids
(bos/eos/pad) are not here: they come from the tokenizer we build, so config and tokenizer agree.
`tiny` presets keep every dimension small (a few MB) but switch on the family's features.
"""

from __future__ import annotations

import copy

from hybridmoe.errors import HybridMoEError

# architecture (config.json model_type) -> HF class in config.json architectures
ARCHS = {
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",
    "kimi_k25": "KimiK25ForConditionalGeneration",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
}

MULTIMODAL_TEXT = {"kimi_k25": ("kimi_k2", "DeepseekV3ForCausalLM")}
"""Architectures whose config.json nests the text model's config under text_config beside a vision_config -> the
model_type and architectures that text_config names."""

TINY_VOCAB = 512

_QWEN2_MOE = {
    "tiny": {
        "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
        "intermediate_size": 96, "max_position_embeddings": 512, "max_window_layers": 3,
        "num_attention_heads": 4, "num_hidden_layers": 3, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False, "use_cache": True,
        "use_sliding_window": False, "vocab_size": TINY_VOCAB, "decoder_sparse_step": 1,
        "mlp_only_layers": [1], "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
        "num_experts_per_tok": 2, "num_experts": 8, "norm_topk_prob": False, "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    },
    "qwen1.5-moe-a2.7b": {
        "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
        "intermediate_size": 5632, "max_position_embeddings": 8192, "max_window_layers": 21,
        "num_attention_heads": 16, "num_hidden_layers": 24, "num_key_value_heads": 16, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False, "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936, "decoder_sparse_step": 1,
        "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4,
        "num_experts": 60, "norm_topk_prob": False, "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    },
}

_QWEN3_MOE = {
    "tiny": {
        "attention_bias": False, "attention_dropout": 0.0, "decoder_sparse_step": 1, "head_dim": 16,
        "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96,
        "max_position_embeddings": 512, "max_window_layers": 2, "mlp_only_layers": [],
        "moe_intermediate_size": 32, "norm_topk_prob": True, "num_attention_heads": 4, "num_experts": 8,
        "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_key_value_heads": 2,
        "output_router_logits": False, "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
        "use_cache": True, "use_sliding_window": False, "vocab_size": TINY_VOCAB,
    },
    "qwen3-30b-a3b": {
        "attention_bias": False, "attention_dropout": 0.0, "decoder_sparse_step": 1, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
        "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
        "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
        "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
        "output_router_logits": False, "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
        "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    },
}

_DEEPSEEK_V2 = {
    # softmax scoring with group_limited_greedy (DeepSeek-V2's routing), no q_lora_rank (V2-Lite's attention)
    "tiny": {
        "attention_bias": False, "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "first_k_dense_replace": 1,
        "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128,
        "kv_lora_rank": 16, "max_position_embeddings": 512, "moe_intermediate_size": 32, "moe_layer_freq": 1,
        "n_group": 4, "n_routed_experts": 16, "n_shared_experts": 2, "norm_topk_prob": False,
        "num_attention_heads": 4, "num_experts_per_tok": 4, "num_hidden_layers": 3, "num_key_value_heads": 4,
        "pretraining_tp": 1, "q_lora_rank": None, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "rms_norm_eps": 1e-6,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 4, "mscale": 0.707, "mscale_all_dim": 0.707,
                         "original_max_position_embeddings": 128, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 16.0, "scoring_func": "softmax", "seq_aux": True,
        "tie_word_embeddings": False, "topk_group": 2, "topk_method": "group_limited_greedy", "use_cache": True,
        "v_head_dim": 16, "vocab_size": TINY_VOCAB,
    },
    "deepseek-v2-lite": {
        "attention_bias": False, "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "first_k_dense_replace": 1,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944,
        "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 1408,
        "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
        "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
        "num_key_value_heads": 16, "pretraining_tp": 1, "q_lora_rank": None, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "rms_norm_eps": 1e-6,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
        "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "use_cache": True,
        "v_head_dim": 128, "vocab_size": 102400,
    },
}

_DEEPSEEK_V3 = {
    # sigmoid scoring with noaux_tc and grouped top-k, q_lora_rank, a dense first layer, YaRN
    "tiny": {
        "attention_bias": False, "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "ep_size": 1,
        "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
        "intermediate_size": 128, "kv_lora_rank": 16, "max_position_embeddings": 512,
        "moe_intermediate_size": 32, "moe_layer_freq": 1, "n_group": 4, "n_routed_experts": 16,
        "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 4, "num_experts_per_tok": 4,
        "num_hidden_layers": 3, "num_key_value_heads": 4, "num_nextn_predict_layers": 0, "pretraining_tp": 1,
        "q_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "rms_norm_eps": 1e-6,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 4, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 128, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
        "tie_word_embeddings": False, "topk_group": 2, "topk_method": "noaux_tc", "use_cache": True,
        "v_head_dim": 16, "vocab_size": TINY_VOCAB,
    },
    # num_nextn_predict_layers is 0, not the real 1: we write no multi-token-prediction layer
    "deepseek-v3": {
        "attention_bias": False, "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "ep_size": 1,
        "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02,
        "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
        "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
        "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
        "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 0,
        "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-6,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
        "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "use_cache": True,
        "v_head_dim": 128, "vocab_size": 129280,
    },
}

_DEEPSEEK_V32 = {
    # DeepSeek-V3's tiny shape with the lightning indexer: 16 index heads of 16 (the rotary's 8 and 8 more), the
    # best 8 positions per query, so prompts of more than 8 tokens attend sparsely
    "tiny": {**_DEEPSEEK_V3["tiny"], "index_head_dim": 16, "index_n_heads": 16, "index_topk": 8},
    # DeepSeek-V3's shape with transformers' DeepseekV32Config indexer defaults (5.25, documented for
    # deepseek-ai/DeepSeek-V3.2-Exp): 64 index heads of 128, the best 2048 positions per query
    "deepseek-v3.2": {**_DEEPSEEK_V3["deepseek-v3"], "index_head_dim": 128, "index_n_heads": 64,
                      "index_topk": 2048},
}

_MIXTRAL = {
    "tiny": {
        "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
        "intermediate_size": 96, "max_position_embeddings": 512, "num_attention_heads": 4,
        "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_key_value_heads": 2, "num_local_experts": 4,
        "output_router_logits": False, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False, "use_cache": True,
        "vocab_size": TINY_VOCAB,
    },
    "mixtral-8x7b": {
        "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
        "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
        "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "output_router_logits": False, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False, "use_cache": True,
        "vocab_size": 32000,
    },
}

_GLM4_MOE = {
    # q/k/v bias and q/k norm, half of each head rotates, sigmoid noaux_tc routing in the best 2 of 4 groups,
    # two shared experts, a dense first layer
    "tiny": {
        "attention_bias": True, "attention_dropout": 0.0, "first_k_dense_replace": 1, "head_dim": 16,
        "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128,
        "max_position_embeddings": 512, "moe_intermediate_size": 32, "n_group": 4, "n_routed_experts": 16,
        "n_shared_experts": 2, "norm_topk_prob": True, "num_attention_heads": 4, "num_experts_per_tok": 4,
        "num_hidden_layers": 3, "num_key_value_heads": 2, "num_nextn_predict_layers": 0,
        "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-5, "rope_scaling": None, "rope_theta": 1000000.0,
        "routed_scaling_factor": 2.5, "tie_word_embeddings": False, "topk_group": 2, "use_cache": True,
        "use_qk_norm": True, "vocab_size": TINY_VOCAB,
    },
    # transformers' Glm4MoeConfig defaults (GLM-4.5-Air's shape); num_nextn_predict_layers is 0, not the
    # real 1: we write no multi-token-prediction layer
    "glm-4.5-air": {
        "attention_bias": True, "attention_dropout": 0.0, "first_k_dense_replace": 1, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 10944,
        "max_position_embeddings": 131072, "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 128,
        "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 96, "num_experts_per_tok": 8,
        "num_hidden_layers": 46, "num_key_value_heads": 8, "num_nextn_predict_layers": 0,
        "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-5, "rope_scaling": None, "rope_theta": 1000000.0,
        "routed_scaling_factor": 1.0, "tie_word_embeddings": False, "topk_group": 1, "use_cache": True,
        "use_qk_norm": False, "vocab_size": 151552,
    },
}

_MINIMAX_M2 = {
    # q/k norms over all heads, half of each head rotates (rotary_dim 8 of head_dim 16), sigmoid routing with
    # the correction bias, 4 of 16 experts, no shared expert, every layer MoE
    "tiny": {
        "attention_dropout": 0.0, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
        "intermediate_size": 32, "max_position_embeddings": 512, "num_attention_heads": 4, "num_experts_per_tok": 4,
        "num_hidden_layers": 3, "num_key_value_heads": 2, "num_local_experts": 16, "num_mtp_modules": 0,
        "qk_norm_type": "per_layer", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rotary_dim": 8,
        "scoring_func": "sigmoid", "shared_intermediate_size": 0, "tie_word_embeddings": False, "use_cache": True,
        "use_mtp": False, "use_qk_norm": True, "use_routing_bias": True, "vocab_size": TINY_VOCAB,
    },
    # MiniMaxAI/MiniMax-M2's config.json less attn_type_list (62 full-attention layers, which transformers does not
    # read); use_mtp false and num_mtp_modules 0, not the release's true and 3: we write no multi-token-prediction
    # modules
    "minimax-m2": {
        "head_dim": 128, "hidden_act": "silu", "hidden_size": 3072, "intermediate_size": 1536,
        "max_position_embeddings": 196608, "mtp_transformer_layers": 1, "num_attention_heads": 48,
        "num_experts_per_tok": 8, "num_hidden_layers": 62, "num_key_value_heads": 8, "num_local_experts": 256,
        "num_mtp_modules": 0, "qk_norm_type": "per_layer", "rms_norm_eps": 1e-6, "rope_theta": 5000000,
        "rotary_dim": 64, "scoring_func": "sigmoid", "shared_intermediate_size": 0, "tie_word_embeddings": False,
        "use_cache": True, "use_mtp": False, "use_qk_norm": True, "use_routing_bias": True, "vocab_size": 200064,
    },
}


def _gpt_oss(layers: int, experts: int) -> dict:
    """openai/gpt-oss-20b's and -120b's config.json (https://huggingface.co/openai/gpt-oss-120b/raw/main/config.json
    and gpt-oss-20b's), which differ only in the layer and expert counts, less quantization_config."""
    return {
        "attention_bias": True, "attention_dropout": 0.0, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
        "layer_types": ["sliding_attention", "full_attention"] * (layers // 2), "max_position_embeddings": 131072,
        "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": layers, "num_key_value_heads": 8,
        "num_local_experts": experts, "output_router_logits": False, "rms_norm_eps": 1e-5,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                         "rope_type": "yarn", "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088,
    }


_GPT_OSS = {
    # attention sinks, q/k/v/o biases, YaRN as released, a window of 8 on the first and last of 3 layers (so short
    # prompts reach past it), 2 of 8 experts with biases and the clamped SwiGLU
    "tiny": {**_gpt_oss(2, 8), "experts_per_token": 2, "head_dim": 16, "hidden_size": 64, "intermediate_size": 32,
             "layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "num_attention_heads": 4,
             "num_experts_per_tok": 2, "num_hidden_layers": 3, "num_key_value_heads": 2, "sliding_window": 8,
             "vocab_size": TINY_VOCAB},
    "gpt-oss-20b": _gpt_oss(24, 32),
    "gpt-oss-120b": _gpt_oss(36, 128),
}

_KIMI_K2 = {
    # DeepSeek-V3's architecture as Kimi-K2 sets it: one expert group (n_group 1, topk_group 1), sigmoid noaux_tc
    # routing scaled by 2.827, one dense first layer, YaRN with beta_fast = beta_slow = 1; a vocabulary of 768
    # tiktoken ranks and Kimi's 256 special ids after them (checkpoint/kimi_tokenizer.py)
    "tiny": {
        "attention_bias": False, "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "first_k_dense_replace": 1,
        "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 128,
        "kv_lora_rank": 16, "max_position_embeddings": 512, "moe_intermediate_size": 32, "moe_layer_freq": 1,
        "n_group": 1, "n_routed_experts": 16, "n_shared_experts": 1, "norm_topk_prob": True,
        "num_attention_heads": 4, "num_experts_per_tok": 4, "num_hidden_layers": 3, "num_key_value_heads": 4,
        "num_nextn_predict_layers": 0, "pretraining_tp": 1, "q_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "rms_norm_eps": 1e-6,
        "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 16, "type": "yarn"},
        "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "seq_aux": True,
        "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc", "use_cache": True,
        "v_head_dim": 16, "vocab_size": 1024,
    },
    # moonshotai/Kimi-K2-Instruct's config.json (model_type kimi_k2, architectures DeepseekV3ForCausalLM) less its
    # FP8 quantization_config
    "kimi-k2": {
        "attention_bias": False, "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "first_k_dense_replace": 1,
        "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
        "kv_lora_rank": 512, "max_position_embeddings": 131072, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
        "n_group": 1, "n_routed_experts": 384, "n_shared_experts": 1, "norm_topk_prob": True,
        "num_attention_heads": 64, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 64,
        "num_nextn_predict_layers": 0, "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "rms_norm_eps": 1e-6,
        "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 50000.0, "routed_scaling_factor": 2.827, "scoring_func": "sigmoid", "seq_aux": True,
        "tie_word_embeddings": False, "topk_group": 1, "topk_method": "noaux_tc", "use_cache": True,
        "v_head_dim": 128, "vocab_size": 163840,
    },
}


def _moonvit_config(*, hidden: int, intermediate: int, heads: int, blocks: int, pos_emb: int, text_hidden: int) -> dict:
    """Kimi-K2.5's vision_config: a MoonViT of `blocks` blocks of `hidden` over 14x14 patches with pos_emb x pos_emb
    position embeddings, whose projector merges 2x2 patches into one embedding of the text model's text_hidden."""
    return {
        "init_pos_emb_height": pos_emb, "init_pos_emb_time": 4, "init_pos_emb_width": pos_emb,
        "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool", "mm_hidden_size": hidden,
        "mm_projector_type": "patchmerger", "patch_size": 14, "pos_emb_type": "divided_fixed",
        "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5, "text_hidden_size": text_hidden,
        "video_attn_type": "spatial_temporal", "vt_hidden_size": hidden, "vt_intermediate_size": intermediate,
        "vt_num_attention_heads": heads, "vt_num_hidden_layers": blocks,
    }


_KIMI_K25_ROPE = {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 64.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                  "type": "yarn"}
_KIMI_K25_TOP = {"ignore_index": -100, "use_unified_vision_chunk": True,
                 "video_placeholder": "<|kimi_k25_video_placeholder|>"}
"""Kimi-K2.5's top-level keys besides the token ids, text_config and vision_config."""
_KIMI_K25 = {
    # the multimodal layout: Kimi-K2's tiny text model (with Kimi-K2.5's norm epsilon and YaRN) under text_config,
    # a one-block vision tower of 16 beside it whose projector merges 2x2 patches into the text model's 64
    "tiny": {
        **_KIMI_K25_TOP,
        "text_config": {**_KIMI_K2["tiny"], "ep_size": 1, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
                        "rope_scaling": {**_KIMI_K25_ROPE, "original_max_position_embeddings": 16}},
        "vision_config": _moonvit_config(hidden=16, intermediate=32, heads=2, blocks=1, pos_emb=4, text_hidden=64),
    },
    # moonshotai/Kimi-K2.5's config.json less its int4 compressed-tensors quantization_config and auto_map. Verified
    # against a transformers print of the release's KimiK25Config (a public model report; the raw file was not at
    # hand): every top-level key written here, every text_config value (Kimi-K2-Instruct's shape with
    # max_position_embeddings 262144, rms_norm_eps 1e-5, ep_size 1 and YaRN factor 64 over 4096 positions with
    # beta_fast 32), text_config's architectures DeepseekV3ForCausalLM, and the vision_config; the same report's
    # weight list gives the tensor names and shapes written. Not verified: text_config's model_type (kimi_k2 here, as
    # other projects' tests of Kimi-K2.5 configs spell it; the print shows its config class's deepseek_v3), and
    # whether the raw file spells YaRN as rope_scaling, as Kimi-K2's does, and states beta_fast (32 is YaRN's
    # default either way)
    "kimi-k2.5": {
        **_KIMI_K25_TOP,
        "text_config": {**_KIMI_K2["kimi-k2"], "ep_size": 1, "max_position_embeddings": 262144, "rms_norm_eps": 1e-5,
                        "rope_scaling": {**_KIMI_K25_ROPE, "original_max_position_embeddings": 4096}},
        "vision_config": _moonvit_config(hidden=1152, intermediate=4304, heads=16, blocks=27, pos_emb=64,
                                         text_hidden=7168),
    },
}

_QWEN3_NEXT = {
    # Gated DeltaNet in layers 0-2 (2 key heads, each shared by 2 value heads), gated attention in layer 3 with a
    # quarter of each head rotating, a dense MLP in layer 1, routed experts with a gated shared expert elsewhere
    "tiny": {
        "attention_bias": False, "attention_dropout": 0.0, "decoder_sparse_step": 1, "full_attention_interval": 4,
        "head_dim": 16, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96,
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_value_head_dim": 16, "max_position_embeddings": 512,
        "mlp_only_layers": [1], "moe_intermediate_size": 32, "norm_topk_prob": True, "num_attention_heads": 4,
        "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 4, "num_key_value_heads": 2,
        "output_router_logits": False, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6, "rope_scaling": None,
        "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 48,
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": TINY_VOCAB,
    },
    # Qwen/Qwen3-Next-80B-A3B-Instruct's config.json less layer_types (full_attention_interval 4 gives the same 48
    # layers); we write no multi-token-prediction module (the release's mtp.*)
    "qwen3-next-80b-a3b": {
        "attention_bias": False, "attention_dropout": 0.0, "decoder_sparse_step": 1, "full_attention_interval": 4,
        "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
        "intermediate_size": 5120, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
        "max_position_embeddings": 262144, "mlp_only_layers": [], "moe_intermediate_size": 512,
        "norm_topk_prob": True, "num_attention_heads": 16, "num_experts": 512, "num_experts_per_tok": 10,
        "num_hidden_layers": 48, "num_key_value_heads": 2, "output_router_logits": False,
        "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 5000000,
        "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512, "tie_word_embeddings": False,
        "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    },
}

_QWEN3_5_MOE_ROPE = {"rope_type": "default", "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                     "mrope_interleaved": True}
_QWEN3_5_MOE = {
    # the text model (model_type qwen3_5_moe_text, as transformers' Qwen3_5MoeForCausalLM saves it): Gated DeltaNet in
    # layers 0-2 (2 key heads, each shared by 2 value heads, projections stored split), gated attention in layer 3
    # with a quarter of each head rotating, routed experts with a gated shared expert in every layer
    "tiny": {
        "model_type": "qwen3_5_moe_text", "attention_bias": False, "attention_dropout": 0.0,
        "full_attention_interval": 4, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
        "initializer_range": 0.02, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_value_head_dim": 16, "max_position_embeddings": 512,
        "moe_intermediate_size": 32, "num_attention_heads": 4, "num_experts": 8, "num_experts_per_tok": 2,
        "num_hidden_layers": 4, "num_key_value_heads": 2, "output_router_logits": False, "rms_norm_eps": 1e-6,
        "rope_parameters": {**_QWEN3_5_MOE_ROPE, "rope_theta": 1000000.0}, "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 48, "tie_word_embeddings": False, "use_cache": True,
        "vocab_size": TINY_VOCAB,
    },
    # transformers' Qwen3_5MoeTextConfig defaults, which its docstring gives as Qwen/Qwen3.5-35B-A3B's shape, with
    # the multimodal release's rotary sections; the text model only (no vision tower, no multi-token prediction)
    "qwen3.5-35b-a3b": {
        "model_type": "qwen3_5_moe_text", "attention_bias": False, "attention_dropout": 0.0,
        "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
        "max_position_embeddings": 32768, "moe_intermediate_size": 512, "num_attention_heads": 16,
        "num_experts": 256, "num_experts_per_tok": 8, "num_hidden_layers": 40, "num_key_value_heads": 2,
        "output_router_logits": False, "rms_norm_eps": 1e-6, "rope_parameters": {**_QWEN3_5_MOE_ROPE,
                                                                                  "rope_theta": 10000.0},
        "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512, "tie_word_embeddings": False,
        "use_cache": True, "vocab_size": 248320,
    },
}

OPTIONAL_KEYS = {
    "qwen3_next": ("mtp_num_hidden_layers",),
    "qwen3_5_moe": ("mtp_num_hidden_layers",),
}
"""Per family, config.json keys its presets leave out that make_checkpoint's overrides may add. mtp_num_hidden_layers
(as Qwen3.5's releases name it; Qwen3-Next's config.json names none though its checkpoints carry one layer) > 0:
that many multi-token-prediction layers written under mtp.* (checkpoint/tensors.py); without it none, as the
presets' checkpoints have always been."""

PRESETS = {
    "qwen2_moe": _QWEN2_MOE,
    "qwen3_moe": _QWEN3_MOE,
    "deepseek_v2": _DEEPSEEK_V2,
    "deepseek_v3": _DEEPSEEK_V3,
    "deepseek_v32": _DEEPSEEK_V32,
    "mixtral": _MIXTRAL,
    "glm4_moe": _GLM4_MOE,
    "minimax_m2": _MINIMAX_M2,
    "gpt_oss": _GPT_OSS,
    "kimi_k2": _KIMI_K2,
    "kimi_k25": _KIMI_K25,
    "qwen3_next": _QWEN3_NEXT,
    "qwen3_5_moe": _QWEN3_5_MOE,
}

FP8_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                           "weight_block_size": [128, 128]}
"""config.json's quantization_config of a block-FP8 checkpoint (DeepSeek-V3's); checkpoint/tensors.py writes its
linears so."""
_DTYPES = {"bf16": "bfloat16", "fp32": "float32", "fp8": "bfloat16"}
"""make-model's --dtype -> config.json's torch_dtype; fp8 writes the linears as block-FP8 (checkpoint/tensors.py)
and the rest in bf16."""


def model_config(arch: str, preset: str, *, layers: int | None = None, dtype: str = "bf16") -> dict:
    """The config.json for `arch`/`preset`, cut to `layers` decoder layers; token ids not yet filled in. A multimodal
    architecture (MULTIMODAL_TEXT) nests the text model's config, cut and typed so, under text_config."""
    if arch not in PRESETS:
        raise HybridMoEError(f"unknown architecture {arch!r}; choose one of: {', '.join(PRESETS)}")
    if preset not in PRESETS[arch]:
        raise HybridMoEError(
            f"unknown preset {preset!r} for {arch}; choose one of: {', '.join(PRESETS[arch])}")
    if dtype not in _DTYPES:
        raise HybridMoEError(f"unknown dtype {dtype!r}; choose one of: {', '.join(_DTYPES)}")
    if layers is not None and layers < 1:
        raise HybridMoEError(f"--layers must be at least 1, got {layers}")
    values = copy.deepcopy(PRESETS[arch][preset])
    if arch not in MULTIMODAL_TEXT:
        return _decoder_config(ARCHS[arch], arch, values, layers, dtype)
    text_type, text_arch = MULTIMODAL_TEXT[arch]
    text = _decoder_config(text_arch, text_type, values.pop("text_config"), layers, dtype)
    return {"architectures": [ARCHS[arch]], "model_type": arch, **values, "text_config": text,
            "tie_word_embeddings": text["tie_word_embeddings"], "torch_dtype": text["torch_dtype"]}


def text_config_of(config: dict) -> dict:
    """The text model's values in a config.json: its text_config in a multimodal layout, else the config itself."""
    return config.get("text_config", config)


def _decoder_config(architecture: str, model_type: str, values: dict, layers: int | None, dtype: str) -> dict:
    """A decoder's config.json from a preset's values, cut to `layers` decoder layers, in `dtype`."""
    cfg = {"architectures": [architecture], "model_type": model_type, **values}
    if layers is not None:
        cfg["num_hidden_layers"] = layers
        if "first_k_dense_replace" in cfg:
            # keep at least one MoE layer: a cut DeepSeek model with only dense layers tests nothing
            cfg["first_k_dense_replace"] = min(cfg["first_k_dense_replace"], layers - 1)
        if "mlp_only_layers" in cfg:
            cfg["mlp_only_layers"] = [i for i in cfg["mlp_only_layers"] if i < layers]
        if "max_window_layers" in cfg:
            cfg["max_window_layers"] = min(cfg["max_window_layers"], layers)
        if cfg.get("layer_types"):  # the preset's pattern, repeated or cut to the new depth
            cfg["layer_types"] = [cfg["layer_types"][i % len(cfg["layer_types"])] for i in range(layers)]
    cfg["torch_dtype"] = _DTYPES[dtype]
    if dtype == "fp8":
        if model_type == "gpt_oss":
            raise HybridMoEError("--dtype fp8: gpt-oss ships its experts as MXFP4, not block-FP8; use bf16 or fp32")
        cfg["quantization_config"] = copy.deepcopy(FP8_QUANTIZATION_CONFIG)
    return cfg
