"""Tiny random float32 models of transformers' own MoE classes, one per family hybridmoe.hf supports, and their bf16
twins, for tests/hf (pytest puts this directory on sys.path).

Weights are redrawn at O(1) scale (transformers' 0.02 init leaves every layer close to the identity, which would
hide mistakes): linear and fused expert weights normal with std 1/sqrt(their input size), norms near 1, every bias,
gpt-oss's sinks and DeepSeek's e_score_correction_bias nonzero.

The bf16 twin is what the native engine's bf16 format computes, in transformers' own code: the model with its
routed experts' weights rounded to bf16, run through transformers' batched_mm experts implementation with the
experts' input x and their activations h = glu(gate, up) rounded to bf16 (the engine reads both in bf16 and
accumulates in float32). Our module and the twin then differ by float32 summation order alone (~1e-7 relative).
"""

from __future__ import annotations

import copy

import torch
import transformers as tf

from hybridmoe.hf.family_layouts import FAMILIES

VOCAB = 96
COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 128, "bos_token_id": 0, "eos_token_id": 1,
          "pad_token_id": 0}
DEEPSEEK = {"num_hidden_layers": 3, "first_k_dense_replace": 1, "num_key_value_heads": 4, "intermediate_size": 96,
            "moe_intermediate_size": 32, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
            "q_lora_rank": None, "kv_lora_rank": 24, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 16}

CASES = {
    "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM,
                  {"intermediate_size": 96, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
                   "num_experts": 8, "num_experts_per_tok": 2}),
    "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM,
                  {"intermediate_size": 96, "moe_intermediate_size": 32, "head_dim": 16, "num_experts": 8,
                   "num_experts_per_tok": 2, "norm_topk_prob": True}),
    "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM,
                {"intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2}),
    "deepseek_v2": (tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM, DEEPSEEK),
    "deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM,
                    {**DEEPSEEK, "n_group": 2, "topk_group": 1, "q_lora_rank": 32, "routed_scaling_factor": 2.5}),
    "glm4_moe": (tf.Glm4MoeConfig, tf.Glm4MoeForCausalLM,
                 {"num_hidden_layers": 3, "first_k_dense_replace": 1, "intermediate_size": 96,
                  "moe_intermediate_size": 32, "head_dim": 16, "n_routed_experts": 8, "n_shared_experts": 1,
                  "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1}),
    "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM,
                {"intermediate_size": 32, "head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2,
                 "sliding_window": 8, "max_position_embeddings": 131072, "swiglu_limit": 0.8}),
    "minimax_m2": (tf.MiniMaxM2Config, tf.MiniMaxM2ForCausalLM,
                   {"intermediate_size": 32, "head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2,
                    "rotary_dim": 8}),
}
"""family -> (config class, model class, config arguments beyond COMMON). swiglu_limit 0.8: gpt-oss's clamps bind
on O(1) activations."""


def tiny_model(family: str) -> torch.nn.Module:
    """The family's tiny random float32 model, in eval mode."""
    config_cls, model_cls, options = CASES[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**COMMON, **options})).float().eval()
    randomize(model, experts_transposed=family == "gpt_oss")
    return model


@torch.no_grad()
def randomize(model: torch.nn.Module, experts_transposed: bool) -> None:
    """Every weight at O(1) scale; experts_transposed: fused experts are [E, in, out] (gpt-oss), else [E, out, in]."""
    g = torch.Generator().manual_seed(1)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if not t.is_floating_point() or "inv_freq" in name:
            continue
        if name.endswith("e_score_correction_bias"):
            t.copy_(0.3 * torch.randn(t.shape, generator=g))
        elif "norm" in name:
            t.copy_(1 + 0.1 * torch.randn(t.shape, generator=g))
        elif "bias" in name or name.endswith("sinks"):
            t.copy_(0.5 * torch.randn(t.shape, generator=g))
        elif "embed_tokens" in name:
            t.copy_(torch.randn(t.shape, generator=g))
        elif t.dim() >= 2:
            fan_in = t.shape[1] if t.dim() == 3 and experts_transposed else t.shape[-1]
            t.copy_(torch.randn(t.shape, generator=g) * fan_in**-0.5)


def bf16_twin(model: torch.nn.Module, family: str, straight_through: bool = False) -> torch.nn.Module:
    """A copy of model that computes its routed experts as the engine's bf16 format does (module docstring);
    straight_through: its roundings of x and h pass gradients unrounded (as the engine's backward reads them), not
    rounded to bf16 as autograd of a cast does."""
    rounded = _RoundedStraightThrough.apply if straight_through else (lambda t: t.bfloat16().float())
    twin = copy.deepcopy(model)
    twin.set_experts_implementation("batched_mm")
    for module in twin.modules():
        if type(module).__name__ != FAMILIES[family].experts_class:
            continue
        with torch.no_grad():
            for name, p in module.named_parameters():
                if not name.endswith("bias"):
                    p.copy_(p.bfloat16().float())
        module.register_forward_pre_hook(lambda _, args: (rounded(args[0]), *args[1:]))
        module._apply_gate = lambda gate_up, glu=module._apply_gate: rounded(glu(gate_up))
    return twin


class _RoundedStraightThrough(torch.autograd.Function):
    """t rounded to bf16 (as float32); its gradient passed through as it is."""

    @staticmethod
    def forward(ctx, t):
        return t.bfloat16().float()

    @staticmethod
    def backward(ctx, grad):
        return grad


def experts_modules(model: torch.nn.Module, family: str) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == FAMILIES[family].experts_class]
