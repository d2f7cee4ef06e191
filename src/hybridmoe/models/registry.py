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
from hybridmoe.models.config_check import checked_config

ARCHITECTURES: dict[str, tuple[str, str]] = {
    "Qwen2MoeForCausalLM": ("hybridmoe.models.qwen_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("hybridmoe.models.qwen_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("hybridmoe.models.mixtral", "MixtralForCausalLM"),
    "DeepseekV2ForCausalLM": ("hybridmoe.models.deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("hybridmoe.models.deepseek", "DeepseekV3ForCausalLM"),
    "DeepseekV32ForCausalLM": ("hybridmoe.models.deepseek_v32", "DeepseekV32ForCausalLM"),
    "KimiK25ForConditionalGeneration": ("hybridmoe.models.kimi_k25", "KimiK25ForConditionalGeneration"),
    "Glm4MoeForCausalLM": ("hybridmoe.models.glm4_moe", "Glm4MoeForCausalLM"),
    "GptOssForCausalLM": ("hybridmoe.models.gpt_oss", "GptOssForCausalLM"),
    "MiniMaxM2ForCausalLM": ("hybridmoe.models.minimax_m2", "MiniMaxM2ForCausalLM"),
    "Qwen3NextForCausalLM": ("hybridmoe.models.qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("hybridmoe.models.qwen3_5_moe", "Qwen3_5MoeForCausalLM"),
    "Qwen3_5MoeForConditionalGeneration": ("hybridmoe.models.qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration"),
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
    except (ValueError, RecursionError) as e:  # ValueError: bad JSON, bad UTF-8, an integer of 4300+ digits
        raise CheckpointError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return raw


def architecture_of(raw: dict, source: str = "config.json") -> str:
    archs = raw.get("architectures")
    if not archs:
        raise CheckpointError(
            f"{source} has no \"architectures\" entry; supported: {', '.join(supported_architectures())}")
    if not isinstance(archs, list) or not isinstance(archs[0], str):
        raise CheckpointError(f"{source}: \"architectures\" must be a list of class names, got "
                              f"{json.dumps(archs)[:60]}; supported: {', '.join(supported_architectures())}")
    return archs[0]


def load_config(model_dir: str | Path) -> tuple[type[MoECausalLM], ModelConfig]:
    """(model class, its config with the family's defaults applied) for a model directory; every value the
    family reads is checked first (models/config_check.py)."""
    raw = read_config_json(model_dir)
    source = str(Path(model_dir) / "config.json")
    cls = get_model_class(architecture_of(raw, source))
    return cls, checked_config(cls, raw, source)
