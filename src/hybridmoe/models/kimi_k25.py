"""Kimi-K2.5's text model (KimiK25ForConditionalGeneration: moonshotai/Kimi-K2.5), Kimi-K2's DeepSeek-V3 decoder
inside a multimodal checkpoint.

config.json nests the text model's config (DeepSeek-V3's keys) under text_config beside a vision_config. The
release's compressed-tensors quantization_config (int4 routed experts in groups of 32, format pack-quantized) sits
inside text_config and is read from there like every other text value; a top-level one counts where text_config
has none. The top level's architectures and model_type stay this class's: they name the checkpoint, not its text
model.

The tensors: the text model under language_model. (language_model.model.layers.N.*, language_model.model.norm,
language_model.lm_head), beside the MoonViT vision tower (vision_tower.*) and its projector into the text model's
embeddings (mm_projector.*). KimiK25ForConditionalGeneration reads the text model under that prefix and skips the
vision tower and the projector: image and video input are not supported (there is no vision tower here; a prompt is
text tokens only). Routing, MLA, YaRN and the MTP-layer skip are DeepSeek-V3's (models/deepseek.py).
"""

from __future__ import annotations

from hybridmoe.models.deepseek import DeepseekV3ForCausalLM
from hybridmoe.models.multimodal import text_config_values

TEXT_PREFIX = "language_model."
"""Where the checkpoint keeps the text model's tensors (ours: model.*, lm_head.weight)."""

VISION_PREFIXES = ("vision_tower.", "mm_projector.")
"""The vision tower's and its projector's tensors, which the text model never reads."""

CHECKPOINT_KEYS = ("architectures", "model_type")
"""Top-level keys that name the multimodal checkpoint and stay over text_config's own."""


def _text_name(name: str) -> str:
    """A checkpoint name -> the text model's (language_model.model.X -> model.X, language_model.lm_head.weight ->
    lm_head.weight)."""
    return name.removeprefix(TEXT_PREFIX)


class KimiK25ForConditionalGeneration(DeepseekV3ForCausalLM):
    """The text model of a Kimi-K2.5 checkpoint: config.json's text_config, tensors under language_model."""

    expert_name_format = TEXT_PREFIX + DeepseekV3ForCausalLM.expert_name_format

    @classmethod
    def config_values(cls, raw: dict) -> dict:
        """text_config over the top level's keys (dtype, token ids and the like), but for CHECKPOINT_KEYS."""
        return super().config_values(text_config_values(raw, cls.__name__, CHECKPOINT_KEYS))

    def expert_key(self, name: str) -> tuple[int, int, str] | None:
        return super().expert_key(_text_name(name))

    def param_target(self, name: str) -> tuple[str, int | None]:
        return super().param_target(_text_name(name))

    def checkpoint_name(self, param_name: str, shard: int | None) -> str:
        return TEXT_PREFIX + super().checkpoint_name(param_name, shard)

    def is_ignored(self, name: str) -> bool:
        return name.startswith(VISION_PREFIXES) or super().is_ignored(_text_name(name))
