"""A device torch cannot run on fails at load with one line naming the devices it can (not a torch
traceback from deep inside the load)."""

import pytest
import torch

from hybridmoe.config import EngineConfig
from hybridmoe.errors import HybridMoEError
from hybridmoe.models.registry import load_config
from hybridmoe.system.auto import resolve_engine_config


@pytest.mark.parametrize("device,message", [
    ("gpu", "'gpu' is not a device name; use 'cpu', 'cuda', 'cuda:N' or 'auto'"),
    ("mps", "'mps': hybridmoe runs on 'cpu' or 'cuda'"),
    ("cuda", "'cuda': (this torch is built without CUDA|torch sees no CUDA device)"),
    ("cuda:7", "'cuda:7': (this torch is built without CUDA|torch sees no CUDA device)"),
])
def test_unusable_devices(tiny_checkpoints, device, message):
    if device.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    path = tiny_checkpoints("qwen3_moe")
    _, config = load_config(path)
    with pytest.raises(HybridMoEError, match=message):
        resolve_engine_config(EngineConfig(device=device), config, torch.float32, path)


def test_a_device_index_past_the_last_gpu(tiny_checkpoints, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    path = tiny_checkpoints("qwen3_moe")
    _, config = load_config(path)
    with pytest.raises(HybridMoEError, match=r"'cuda:2': torch sees 2 CUDA device\(s\), cuda:0 to cuda:1"):
        resolve_engine_config(EngineConfig(device="cuda:2"), config, torch.float32, path)
