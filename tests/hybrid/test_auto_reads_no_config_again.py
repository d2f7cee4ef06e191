"""The automatic choices come from the config the caller loaded: system/auto.py reads no config.json of its
own (a load reads it once), so a directory without one gives the same choices."""

import torch

from hybridmoe.config import EngineConfig
from hybridmoe.models.registry import load_config
from hybridmoe.system.auto import resolve_engine_config


def test_streaming_choice_needs_only_the_loaded_config(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints("mixtral")
    _, config = load_config(path)
    # a hybrid split with streaming asked for: the one choice that sizes the model's layers
    ec = EngineConfig(device="cpu", expert_backend="native", expert_format="int4", expert_group_size=32,
                      gpu_experts_per_layer=2, prefill_streaming="on")
    without_config_json = resolve_engine_config(ec, config, torch.bfloat16, tmp_path)
    assert without_config_json == resolve_engine_config(ec, config, torch.bfloat16, path)
    assert without_config_json.prefill_streaming == "on"
