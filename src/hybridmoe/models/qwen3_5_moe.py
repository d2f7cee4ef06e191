"""Qwen3.5-MoE's text model (Qwen3_5MoeForCausalLM: Qwen3.5-35B-A3B, -122B-A10B, -397B-A17B, Qwen3.6-35B-A3B), and
the text part of its multimodal checkpoints (Qwen3_5MoeForConditionalGeneration).

Qwen3-Next's decoder (models/qwen3_next.py: Gated DeltaNet and gated-attention layers, (1 + weight) norms, routed
experts plus a shared expert gated by sigmoid) with what transformers' Qwen3_5Moe classes change:
  - the Gated DeltaNet's input projections are stored split, each part holding all its heads (in_proj_qkv, in_proj_z,
    in_proj_b, in_proj_a); they load as the shards of the layer's merged in_proj_qkvz and in_proj_ba;
  - every layer is sparse and the top-k routing weights are always renormalized: the config has no intermediate_size,
    decoder_sparse_step, mlp_only_layers or norm_topk_prob, and values of them in config.json are not read;
  - rope_parameters may carry mrope_section and mrope_interleaved, which split the rotary frequencies between
    temporal, height and width positions for images and video. A text token's three positions are all its position,
    so for text the rotation is plain rotary over head_dim * partial_rotary_factor dimensions.

The multimodal checkpoints nest the text config under text_config and store the text model under
model.language_model.* (lm_head at the top level): Qwen3_5MoeForConditionalGeneration reads those and skips the
vision tower (model.visual.*). Both keep the multi-token-prediction module (mtp.*, top-level in either layout) as
Qwen3-Next does: skipped, or built and loaded when the config is marked for it (models/mtp.py). Image and video inputs
are not supported: there is no vision tower here.
"""

from __future__ import annotations

from hybridmoe.models.multimodal import text_config_values
from hybridmoe.models.qwen3_next import DEFAULT_FULL_ATTENTION_INTERVAL, Qwen3NextForCausalLM

ALWAYS_SPARSE = {"intermediate_size": 0, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True}
"""What transformers' Qwen3_5MoeSparseMoeBlock does in every layer, in Qwen3-Next's config names."""

TEXT_PREFIX = "model.language_model."
"""Where the multimodal checkpoints keep the text model's tensors (ours: model.*)."""

IGNORED_PREFIXES = ("model.visual.",)


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    """Qwen3-Next's layers with the flat Gated DeltaNet projections and a sparse MLP in every layer."""

    config_defaults = {
        "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
        "num_key_value_heads": 2, "head_dim": 256, "hidden_act": "silu", "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "attention_bias": False, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        "num_experts_per_tok": 8, "num_experts": 256, "layer_types": None,
        "full_attention_interval": DEFAULT_FULL_ATTENTION_INTERVAL,
    }

    flat_projections = True

    packed_modules = {
        **Qwen3NextForCausalLM.packed_modules,
        "in_proj_qkv": ("in_proj_qkvz", 0), "in_proj_z": ("in_proj_qkvz", 1),
        "in_proj_b": ("in_proj_ba", 0), "in_proj_a": ("in_proj_ba", 1),
    }

    @classmethod
    def config_values(cls, raw: dict) -> dict:
        return {**super().config_values(raw), **ALWAYS_SPARSE}

    def is_ignored(self, name: str) -> bool:
        return name.startswith(IGNORED_PREFIXES) or super().is_ignored(name)


def _text_name(name: str) -> str:
    """A multimodal checkpoint's name -> the text model's (model.language_model.X -> model.X)."""
    return "model." + name.removeprefix(TEXT_PREFIX) if name.startswith(TEXT_PREFIX) else name


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM):
    """The text model of a multimodal checkpoint: config.json's text_config, tensors under model.language_model."""

    expert_name_format = TEXT_PREFIX + "layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight"

    @classmethod
    def config_values(cls, raw: dict) -> dict:
        """text_config over the top level's keys (quantization_config, dtype and the like live there)."""
        return super().config_values(text_config_values(raw, "Qwen3_5MoeForConditionalGeneration"))

    def expert_key(self, name: str) -> tuple[int, int, str] | None:
        return super().expert_key(_text_name(name))

    def param_target(self, name: str) -> tuple[str, int | None]:
        return super().param_target(_text_name(name))

    def checkpoint_name(self, param_name: str, shard: int | None) -> str:
        name = super().checkpoint_name(param_name, shard)
        return TEXT_PREFIX + name.removeprefix("model.") if name.startswith("model.") else name
