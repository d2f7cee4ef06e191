"""The loader packs each MoE layer straight from the mapped checkpoint, one expert at a time (and releases
each expert's pages): the same packed bytes as CpuExperts on the layer's stacked tensors in the model dtype."""

import numpy as np
import pytest
import torch

from hybridmoe import CpuExperts
from hybridmoe.checkpoint.make import make_checkpoint
from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.models.base import EXPERT_PROJS
from hybridmoe.weights.safetensors import SafetensorsCheckpoint


@pytest.mark.parametrize("fmt,checkpoint_dtype", [("bf16", "bf16"), ("int4", "bf16"), ("int8", "fp32")])
def test_loaded_experts_are_the_stacked_layers_packed(tmp_path, fmt, checkpoint_dtype):
    # An fp32 checkpoint loads in bfloat16: its experts are rounded to bf16 before packing, as stacking did.
    make_checkpoint("qwen3_moe", "tiny", tmp_path, dtype=checkpoint_dtype, progress=False)
    loaded = load_model(tmp_path, EngineConfig(device="cpu", dtype="bfloat16", expert_backend="native",
                                               expert_format=fmt, expert_group_size=32, cache_dir="", cpu_threads=2))
    model, E = loaded.model, loaded.model.expert_dims()[0]
    assert loaded.experts.layers() == model.moe_layers
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        for layer in model.moe_layers:
            stacked = [torch.stack([ckpt.get(model.expert_name(layer, e, p)) for e in range(E)]).to(torch.bfloat16)
                       for p in EXPERT_PROJS]
            want = CpuExperts(*stacked, format=fmt, group_size=32, threads=2).packed_state()["buffers"]
            got = loaded.experts.layer_experts(layer).packed_state()["buffers"]
            assert want.keys() == got.keys()
            for name in want:
                assert np.array_equal(np.asarray(want[name]), np.asarray(got[name])), (layer, name)
