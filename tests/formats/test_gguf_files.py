"""GGUF files: a split loads like one file; a missing part, a truncated file, a wrong magic, an unknown
tensor type and an unsupported architecture each fail with one line naming the file."""

import json

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_writer import write_qwen3_gguf

from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.errors import CheckpointError
from hybridmoe.weights.safetensors import SafetensorsCheckpoint


def q8_except_norms(name):
    return Q.F32 if "norm" in name else Q.Q8_0


@pytest.fixture(scope="module")
def tiny_tensors(tiny_qwen3):
    with SafetensorsCheckpoint(tiny_qwen3) as ckpt:
        tensors = {n: ckpt.get(n) for n in ckpt.weight_names()}
    return tensors, json.loads((tiny_qwen3 / "config.json").read_text())


def write(tmp_path, tiny_qwen3, tiny_tensors, **kw):
    tensors, config = tiny_tensors
    write_qwen3_gguf(tensors, config, tiny_qwen3, tmp_path / "model.gguf", q8_except_norms, **kw)


def load(path, tmp_path):
    return load_model(path, EngineConfig(dtype="float32", cache_dir=str(tmp_path / "cache")))


def first_layer_weights(loaded):
    return loaded.model.model.layers[0].self_attn.qkv_proj.weight


def test_split_loads_like_one_file(tmp_path, tiny_qwen3, tiny_tensors):
    (tmp_path / "one").mkdir()
    (tmp_path / "split").mkdir()
    write(tmp_path / "one", tiny_qwen3, tiny_tensors)
    write(tmp_path / "split", tiny_qwen3, tiny_tensors, split_max_tensors=10)
    parts = sorted((tmp_path / "split").glob("*.gguf"))
    assert len(parts) > 2 and parts[0].name.startswith("model-00001-of-")
    one = load(tmp_path / "one" / "model.gguf", tmp_path)
    split = load(parts[1], tmp_path)  # any part names the whole model
    for (name, a), b in zip(one.model.state_dict().items(), split.model.state_dict().values()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)


def test_missing_split_part(tmp_path, tiny_qwen3, tiny_tensors):
    write(tmp_path, tiny_qwen3, tiny_tensors, split_max_tensors=10)
    parts = sorted(tmp_path.glob("model-*.gguf"))
    parts[1].unlink()
    with pytest.raises(CheckpointError, match=rf"GGUF split part 2 of {len(parts)} \(model-00002-of-.*\) is missing"):
        load(parts[0], tmp_path)


def test_truncated_file(tmp_path, tiny_qwen3, tiny_tensors):
    write(tmp_path, tiny_qwen3, tiny_tensors)
    path = tmp_path / "model.gguf"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match=r"model.gguf is truncated or corrupt"):
        load(path, tmp_path)


def test_wrong_magic(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(CheckpointError, match=r"is not a GGUF file \(magic b'GGML', expected b'GGUF'\)"):
        load(path, tmp_path)


def write_one_tensor(path, arch: str, name: str) -> None:
    """A GGUF file of architecture arch holding one float32 [4, 32] tensor of zeros."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tensor(name, np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unknown_tensor_type(tmp_path):
    path = tmp_path / "model.gguf"
    write_one_tensor(path, "qwen3moe", "zzz")
    raw = bytearray(path.read_bytes())
    # tensor info: name, n_dims (u32), dims (u64 each), type (u32)
    at = raw.index(b"zzz") + 3 + 4 + 2 * 8
    raw[at:at + 4] = (99).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=r"model.gguf has a tensor of unknown type"):
        load(path, tmp_path)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "model.gguf"
    write_one_tensor(path, "gemma3", "token_embd.weight")
    with pytest.raises(CheckpointError, match=r"GGUF architecture 'gemma3' is not supported"):
        load(path, tmp_path)
