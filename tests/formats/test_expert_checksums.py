"""Each packed expert carries a CRC-32 in the manifest (convert output and expert cache alike): a flipped byte
in any expert fails the load with one line naming the file, the layer and the expert; verify_experts "header"
skips the check; a directory written before the checksums loads with a warning, a cache entry is rebuilt."""

import argparse
import json
import struct
import warnings

import pytest

from hybridmoe.commands.engine_args import add_engine_arguments, engine_kwargs
from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.errors import CheckpointError, HybridMoEError
from hybridmoe.weights.expert_cache import MANIFEST, read_manifest, verify_layers

E = 8
from converted import CONVERTED_LOAD as OPTIONS


def load(path, **kw):
    return load_model(path, EngineConfig(**{**OPTIONS, **kw}))


def flip_expert_byte(layer_file, expert, buffer="gate.0.w", at=5):
    """XOR one byte of `expert`'s part of a packed buffer (every buffer is [E, ...], expert-major)."""
    raw = bytearray(layer_file.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    begin, end = json.loads(raw[8:8 + n])[buffer]["data_offsets"]
    raw[8 + n + begin + expert * (end - begin) // E + at] ^= 0x10
    layer_file.write_bytes(bytes(raw))


def test_convert_writes_a_crc_per_expert(converted):
    manifest = read_manifest(converted)
    assert manifest["layout_version"] == 2
    for entry in manifest["layers"].values():
        assert len(entry["expert_crc32"]) == E and len(set(entry["expert_crc32"])) == E


@pytest.mark.parametrize("buffer", ["gate.0.w", "down.0.scale"])
def test_a_flipped_byte_in_expert_3_names_the_file_layer_and_expert(converted, buffer):
    layer_file = converted / "experts" / "layer-00001.safetensors"
    flip_expert_byte(layer_file, 3, buffer)
    with pytest.raises(CheckpointError, match=r"layer-00001.safetensors: expert 3 of layer 1 does not match its "
                                              r"checksum in hybridmoe_experts.json") as e:
        load(converted)
    assert "\n" not in str(e.value)


def test_the_first_corrupt_layer_in_order_is_reported(converted):
    for layer in (1, 0):
        flip_expert_byte(converted / "experts" / f"layer-0000{layer}.safetensors", 6)
    with pytest.raises(CheckpointError, match="expert 6 of layer 0 does not match"):
        verify_layers(converted, read_manifest(converted), [0, 1], threads=2)


def test_verify_experts_header_skips_the_expert_checksums(converted):
    flip_expert_byte(converted / "experts" / "layer-00000.safetensors", 3)
    loaded = load(converted, verify_experts="header")
    assert loaded.experts.layer_experts(0).num_experts == E


def test_verify_experts_is_an_engine_option_and_a_flag():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_kwargs(parser.parse_args(["--verify-experts", "header"])) == {"verify_experts": "header"}
    assert EngineConfig().verify_experts == "full"
    with pytest.raises(HybridMoEError, match="verify_experts must be one of full, header, got 'all'"):
        EngineConfig(verify_experts="all")


def as_layout_version_1(packed_dir):
    manifest = json.loads((packed_dir / MANIFEST).read_text())
    manifest["layout_version"] = 1
    for entry in manifest["layers"].values():
        del entry["expert_crc32"]
    (packed_dir / MANIFEST).write_text(json.dumps(manifest))


def test_a_directory_converted_before_the_checksums_loads_with_a_warning(converted):
    as_layout_version_1(converted)
    with pytest.warns(UserWarning, match="converted without per-expert checksums") as record:
        load(converted)
    assert len(record) == 1 and "\n" not in str(record[0].message)


def test_a_cache_entry_without_checksums_or_with_a_corrupt_expert_is_rebuilt(tiny_qwen3, tmp_path):
    load(tiny_qwen3, cache_dir=str(tmp_path))
    (entry,) = (tmp_path / "experts").iterdir()
    as_layout_version_1(entry)
    with pytest.warns(UserWarning, match="ignoring the packed-expert cache entry .*without per-expert checksums"):
        load(tiny_qwen3, cache_dir=str(tmp_path))
    assert read_manifest(entry)["layout_version"] == 2
    flip_expert_byte(entry / "experts" / "layer-00001.safetensors", 4)
    with pytest.warns(UserWarning, match="expert 4 of layer 1 does not match its checksum"):
        load(tiny_qwen3, cache_dir=str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load(tiny_qwen3, cache_dir=str(tmp_path))  # rebuilt: read back without complaint
