"""A GGUF load dequantizes several experts at once (gguf's numpy dequantization runs on one core; one a core),
and packs them in expert order: the same experts as one read at a time."""

import json
import threading

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_writer import write_qwen3_gguf

import hybridmoe.weights.loader as loader
from hybridmoe.config import EngineConfig
from hybridmoe.weights.gguf_checkpoint import GGUFCheckpoint
from hybridmoe.weights.safetensors import SafetensorsCheckpoint

OPTIONS = dict(dtype="float32", expert_backend="native", expert_format="int8", cpu_threads=1, cache_dir="")


@pytest.fixture(scope="module")
def gguf_path(tiny_qwen3, tmp_path_factory):
    with SafetensorsCheckpoint(tiny_qwen3) as ckpt:
        tensors = {n: ckpt.get(n) for n in ckpt.weight_names()}
    config = json.loads((tiny_qwen3 / "config.json").read_text())
    path = tmp_path_factory.mktemp("gguf") / "model.gguf"
    write_qwen3_gguf(tensors, config, tiny_qwen3, path, lambda name: Q.F32 if "norm" in name else Q.Q8_0)
    return path


def experts(loaded):
    layers = loaded.experts
    return [t for layer in layers.layers() for e in range(8) for t in layers.layer_experts(layer).dequantized(e)]


def test_experts_are_read_several_at_once_and_packed_in_order(gguf_path, monkeypatch):
    monkeypatch.setattr(GGUFCheckpoint, "single_core_reads", False)
    one_at_a_time = experts(loader.load_model(gguf_path, EngineConfig(**OPTIONS)))
    monkeypatch.setattr(GGUFCheckpoint, "single_core_reads", True)
    monkeypatch.setattr(loader.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    read, met = GGUFCheckpoint._read, threading.Barrier(2, timeout=30)

    def read_with_another(self, gguf_name, expert):
        if expert in (0, 1) and gguf_name == "blk.0.ffn_gate_exps.weight":
            met.wait()  # experts 0 and 1 are read at the same time, or never get past here
        return read(self, gguf_name, expert)

    monkeypatch.setattr(GGUFCheckpoint, "_read", read_with_another)
    for got, want in zip(experts(loader.load_model(gguf_path, EngineConfig(**OPTIONS))), one_at_a_time, strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
