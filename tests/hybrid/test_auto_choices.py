"""With only a model directory, the engine picks the device, expert backend and budget on its own."""

import torch

from hybridmoe.config import EngineConfig, uses_hybrid
from hybridmoe.experts.cpu_experts import CpuExperts
from hybridmoe.experts.expert_bytes import cpu_expert_bytes
from hybridmoe.models.registry import load_config
from hybridmoe.system.auto import resolve_engine_config


def resolved(path, dtype, **options):
    _, config = load_config(path)
    return resolve_engine_config(EngineConfig(**options), config, dtype, path)


def test_float32_models_keep_the_exact_torch_reference(tiny_checkpoints):
    ec = resolved(tiny_checkpoints("qwen3_moe"), torch.float32)
    assert ec.expert_backend == "torch" and ec.device == "cpu"


def test_bf16_models_get_the_native_engine_and_no_budget_without_a_gpu(tiny_checkpoints):
    ec = resolved(tiny_checkpoints("qwen3_moe"), torch.bfloat16)
    assert ec.expert_backend == "native"
    assert ec.gpu_memory_budget is None and not uses_hybrid(ec)


def test_explicit_choices_are_kept(tiny_checkpoints):
    ec = resolved(tiny_checkpoints("qwen3_moe"), torch.bfloat16, expert_backend="torch", gpu_memory_budget="1GiB")
    assert ec.expert_backend == "torch" and ec.gpu_memory_budget == 1 << 30 and uses_hybrid(ec)


def test_the_floor_counts_the_bytes_the_native_engine_really_packs():
    for inter, hidden in [(64, 128), (128, 192)]:
        for fmt, group in [("bf16", 128), ("int8", 128), ("int4", 32), ("int4", 64)]:
            experts = CpuExperts(torch.randn(2, inter, hidden), torch.randn(2, inter, hidden),
                                 torch.randn(2, hidden, inter), format=fmt, group_size=group, threads=1)
            assert experts.packed_bytes == 2 * cpu_expert_bytes(fmt, inter, hidden, group), (fmt, inter, hidden)
