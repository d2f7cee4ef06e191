"""A large GGUF tensor dequantizes in row ranges on several threads at once (gguf's numpy dequantization runs
on one core), to the same float32 values as in one piece."""

import itertools
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_writer import write_qwen3_gguf

import hybridmoe.weights.gguf_checkpoint as gguf_checkpoint
from hybridmoe.weights.gguf_checkpoint import GGUFCheckpoint
from hybridmoe.weights.gguf_file import GGUFFiles
from hybridmoe.weights.safetensors import SafetensorsCheckpoint


@pytest.fixture(scope="module")
def gguf_path(tiny_qwen3, tmp_path_factory):
    with SafetensorsCheckpoint(tiny_qwen3) as ckpt:
        tensors = {n: ckpt.get(n) for n in ckpt.weight_names()}
    config = json.loads((tiny_qwen3 / "config.json").read_text())
    path = tmp_path_factory.mktemp("gguf") / "model.gguf"
    write_qwen3_gguf(tensors, config, tiny_qwen3, path, lambda name: Q.F32 if "norm" in name else Q.Q8_0)
    return path


def read_all(path) -> dict[str, torch.Tensor]:
    ckpt = GGUFCheckpoint(GGUFFiles(path))
    return {name: ckpt.get(name) for names in ckpt.names_by_file().values() for name in names}


@pytest.fixture
def four_threads(monkeypatch):
    pool = ThreadPoolExecutor(4)
    monkeypatch.setattr(gguf_checkpoint, "_pool", lambda: pool)
    yield
    pool.shutdown()


def test_row_ranges_dequantize_at_once_to_the_same_values(gguf_path, four_threads, monkeypatch):
    monkeypatch.setattr(gguf_checkpoint, "_CHUNK_WEIGHTS", 1 << 40)
    whole = read_all(gguf_path)
    monkeypatch.setattr(gguf_checkpoint, "_CHUNK_WEIGHTS", 8 * 64)  # 8 rows of the tiny model's 64 columns
    dequantize, calls, met = gguf_checkpoint.dequantize, itertools.count(), threading.Barrier(2, timeout=10)

    def beside_another(data, qtype):
        if data.shape[0] == 8 and next(calls) < 2:  # a row range of a tensor in several
            met.wait()  # the first two row ranges run at the same time, or never get past here
        return dequantize(data, qtype)

    monkeypatch.setattr(gguf_checkpoint, "dequantize", beside_another)
    chunked = read_all(gguf_path)
    assert next(calls) > 2
    for name, want in whole.items():
        torch.testing.assert_close(chunked[name], want, atol=0, rtol=0, msg=name)
