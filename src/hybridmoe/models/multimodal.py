"""What the text models of multimodal checkpoints share: config.json nests the text model's config under
text_config beside a vision_config, and keeps the checkpoint-wide keys (dtype, token ids, a quantization_config) at
its top level. The text model reads the two as one dict, text_config's values over the top level's; the vision
config is not read (image and video input are not supported: there is no vision tower here)."""

from __future__ import annotations

from hybridmoe.errors import CheckpointError


def text_config_values(raw: dict, architecture: str, kept: tuple[str, ...] = ()) -> dict:
    """config.json's dict of `architecture` -> its text model's: text_config over the top level's keys, but for
    `kept`, top-level keys that stay the top level's; a CheckpointError when text_config is not an object."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"config.json of {architecture} must hold the text model's config as an object under "
                              "text_config")
    outer = {k: v for k, v in raw.items() if k not in ("text_config", "vision_config")}
    return {**outer, **text, **{k: outer[k] for k in kept if k in outer}}
