"""A split GGUF model named as org/name:QUANT from a Hub cache the test lays out (snapshots/<commit>/ beside
another quant's file, refs/main naming the commit; offline) loads the same weights as its first part by path."""

import json

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_writer import write_qwen3_gguf
from hub_cache import put, use_offline_cache

from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.weights.safetensors import SafetensorsCheckpoint

COMMIT = "c" * 40


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    return use_offline_cache(tmp_path / "hub", monkeypatch)


def test_a_split_gguf_by_repo_and_quant_loads_like_its_path(tmp_path, tiny_qwen3, offline_hub):
    with SafetensorsCheckpoint(tiny_qwen3) as ckpt:
        tensors = {n: ckpt.get(n) for n in ckpt.weight_names()}
    config = json.loads((tiny_qwen3 / "config.json").read_text())
    local = tmp_path / "local"
    local.mkdir()
    write_qwen3_gguf(tensors, config, tiny_qwen3, local / "Tiny-Q8_0.gguf",
                     lambda name: Q.F32 if "norm" in name else Q.Q8_0, split_max_tensors=10)
    parts = sorted(local.glob("Tiny-Q8_0-*.gguf"))
    assert len(parts) > 2
    put(offline_hub, "org/tiny-GGUF", {**{p.name: p.read_bytes() for p in parts},
                                       "Tiny-F16.gguf": b"another quant, never read"}, COMMIT)

    engine_config = EngineConfig(dtype="float32", cache_dir=str(tmp_path / "cache"))
    by_name = load_model("org/tiny-GGUF:q8_0", engine_config)
    by_path = load_model(parts[0], engine_config)
    for (name, a), b in zip(by_name.model.state_dict().items(), by_path.model.state_dict().values()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
