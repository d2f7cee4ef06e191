"""config.json "architectures"[0] (the HF class name) -> our model class, and the config it reads.

Model modules are imported only when their architecture is asked for, so one family's
missing or broken module never stops the others from loading.
"""

from __future__ import annotations

import json
from importlib import import_module
from pathlib import Path

from hybridmoe.errors import CheckpointError
from hybridmoe.models.base import ModelConfig, MoECausalLM

ARCHITECTURES: dict[str, tuple[str, str]] = {
    "Qwen2MoeForCausalLM": ("hybridmoe.models.qwen_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("hybridmoe.models.qwen_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("hybridmoe.models.mixtral", "MixtralForCausalLM"),
    "DeepseekV2ForCausalLM": ("hybridmoe.models.deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("hybridmoe.models.deepseek", "DeepseekV3ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def get_model_class(architecture: str) -> type[MoECausalLM]:
    if architecture not in ARCHITECTURES:
        raise CheckpointError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}")
    module, name = ARCHITECTURES[architecture]
    return getattr(import_module(module), name)


def read_config_json(model_dir: str | Path) -> dict:
    """The raw config.json of a model directory, with a clear error for each way it can be unusable."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory {str(model_dir)!r} does not exist (or is not a directory)")
    path = model_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{model_dir} has no config.json; point at a Hugging Face model directory")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return raw


def architecture_of(raw: dict, source: str = "config.json") -> str:
    archs = raw.get("architectures")
    if not archs or not isinstance(archs, list):
        raise CheckpointError(
            f"{source} has no \"architectures\" entry; supported: {', '.join(supported_architectures())}")
    return archs[0]


def load_config(model_dir: str | Path) -> tuple[type[MoECausalLM], ModelConfig]:
    """(model class, its config with the family's defaults applied) for a model directory."""
    raw = read_config_json(model_dir)
    cls = get_model_class(architecture_of(raw, str(Path(model_dir) / "config.json")))
    try:
        return cls, cls.make_config(raw)
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"{Path(model_dir) / 'config.json'} is missing or has a malformed field: {e}") from None
