"""Every value of a packed-experts manifest is checked by type and range on read: a wrong one is a one-line
CheckpointError naming its key; so is a wrongly typed quantization_config value."""

import json

import pytest

from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.errors import CheckpointError
from hybridmoe.weights.convert import convert_checkpoint
from hybridmoe.weights.expert_cache import MANIFEST, read_manifest
from hybridmoe.weights.native_format import source_expert_format


@pytest.fixture(scope="module")
def converted(tiny_qwen3, tmp_path_factory):
    out = tmp_path_factory.mktemp("manifest") / "conv"
    convert_checkpoint(tiny_qwen3, out, format="int4", group_size=32, threads=1, progress=False)
    return out


@pytest.fixture
def manifest_path(converted):
    path = converted / MANIFEST
    original = path.read_bytes()
    yield path
    path.write_bytes(original)


DELETE = object()


def edited(path, key, value):
    """The manifest with the value at the dotted key path replaced (value DELETE: removed)."""
    manifest = json.loads(path.read_text())
    *parents, last = key.split(".")
    node = manifest
    for part in parents:
        node = node[part]
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    path.write_text(json.dumps(manifest))


CASES = [
    ("layout_version", "2", r"layout version \"2\""),
    ("layout_version", True, r"layout version true"),
    ("format", 8, r"format must be one of bf16, int8, int4, fp8, got 8"),
    ("group_size", "32", r"group_size must be 32, 64 or 128, got \"32\""),
    ("group_size", 48, r"group_size must be 32, 64 or 128, got 48"),
    ("zero_points", "no", r"zero_points must be true or false"),
    ("source", "x", r"source must be an object"),
    ("layers", [], r"layers must be an object"),
    ("layers.0", 3, r"layers.0 must be an object"),
    ("layers.0.file", "../../config.json", r"layers.0.file must be \"experts/layer-00000.safetensors\""),
    ("layers.0.shape", ["8", 64, 32], r"layers.0.shape must be 3 positive integers"),
    ("layers.0.shape", [0, 64, 32], r"layers.0.shape must be 3 positive integers"),
    ("layers.0.header_sha256", 123, r"layers.0.header_sha256 must be a sha256 in hex, got 123"),
    ("layers.1.probe_sha256", DELETE, r"layers.1.probe_sha256 must be a sha256 in hex, got null"),
    ("layers.1.expert_crc32", [1, 2], r"layers.1.expert_crc32 must be a CRC-32 per expert \(8 integers"),
    ("layers.1.expert_crc32", [-1] * 8, r"layers.1.expert_crc32 must be a CRC-32 per expert"),
    ("layers.1.expert_crc32", [2**32] * 8, r"layers.1.expert_crc32 must be a CRC-32 per expert"),
    ("layers.1.expert_crc32", "abc", r"layers.1.expert_crc32 must be a CRC-32 per expert"),
]


@pytest.mark.parametrize(("key", "value", "message"), CASES, ids=[f"{k}={v!r}" for k, v, _ in CASES])
def test_a_wrong_value_names_its_key(manifest_path, key, value, message):
    edited(manifest_path, key, value)
    with pytest.raises(CheckpointError, match=message) as e:
        read_manifest(manifest_path.parent)
    assert "\n" not in str(e.value) and str(manifest_path) in str(e.value)


def test_a_layer_key_that_is_not_a_number(manifest_path):
    manifest = json.loads(manifest_path.read_text())
    manifest["layers"]["01"] = manifest["layers"].pop("1")
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"the layer key '01' must be a layer number"):
        read_manifest(manifest_path.parent)


def test_the_load_fails_with_the_same_line(manifest_path):
    edited(manifest_path, "layers.0.shape", "8x64x32")
    with pytest.raises(CheckpointError, match=r"layers.0.shape must be 3 positive integers \[E, H, I\], got "
                                              r"\"8x64x32\"; convert again"):
        load_model(manifest_path.parent, EngineConfig(expert_backend="native", expert_format="int4",
                                                      expert_group_size=32, cpu_threads=1, dtype="float32",
                                                      cache_dir=""))


@pytest.mark.parametrize(("key", "value"), [("bits", "4"), ("group_size", 12.5), ("bits", 0)])
def test_a_wrongly_typed_quantization_config_value_names_its_key(tmp_path, key, value):
    config = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, key: value}}
    with pytest.raises(CheckpointError, match=rf"quantization_config.{key} must be a positive integer"):
        source_expert_format(tmp_path, config)


def test_gptq_group_size_minus_one_means_one_group_per_row(tmp_path):
    config = {"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": -1}}
    assert source_expert_format(tmp_path, config) == ("int4", None, "GPTQ 4-bit g-1")
