"""A converted directory that was changed, cut short or mixed up fails to load with a one-line error."""

import json
import struct

import pytest
from converted import CONVERTED_LOAD as OPTIONS

from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.errors import CheckpointError


def load(path):
    return load_model(path, EngineConfig(**OPTIONS))


def data_start(path):
    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


def test_truncated_layer_file(converted):
    layer = converted / "experts" / "layer-00001.safetensors"
    layer.write_bytes(layer.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"layer-00001.safetensors is truncated .*convert again"):
        load(converted)


def test_rewritten_header(converted):
    layer = converted / "experts" / "layer-00000.safetensors"
    raw = bytearray(layer.read_bytes())
    i = raw.index(b'"int4"')
    raw[i:i + 6] = b'"int8"'
    layer.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        load(converted)


def test_corrupt_expert_weights(converted):
    layer = converted / "experts" / "layer-00000.safetensors"
    raw = bytearray(layer.read_bytes())
    start = data_start(layer)
    raw[start:start + 64] = bytes(b ^ 0xFF for b in raw[start:start + 64])
    layer.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="do not unpack to the weights they were written with"):
        load(converted)


def test_missing_layer_file(converted):
    (converted / "experts" / "layer-00001.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"layer-00001.safetensors is missing; convert again"):
        load(converted)


def test_config_of_another_shape(converted):
    config = json.loads((converted / "config.json").read_text())
    config["moe_intermediate_size"] = 64
    (converted / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"holds experts of shape \[8, 64, 32\] .* needs \[8, 64, 64\]"):
        load(converted)


def test_manifest_that_is_not_json(converted):
    (converted / "hybridmoe_experts.json").write_text("{")
    with pytest.raises(CheckpointError, match="not a valid packed-experts manifest"):
        load(converted)
