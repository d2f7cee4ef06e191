"""Whole tiny models with routed experts split by every placement policy give the all-reference logits."""

import pytest
import torch
from hybrid_helpers import FP32, load, prompt_logits

from hybridmoe.config import EngineConfig
from hybridmoe.experts.hybrid import HybridExperts
from hybridmoe.experts.placement import ExpertStats, model_footprint
from hybridmoe.models.registry import load_config

FAMILIES = ["qwen3_moe", "qwen2_moe", "deepseek_v3", "mixtral"]
POLICIES = ["uniform", "frequency", "front-loading", "per-layer"]


def footprint(path):
    cls, config = load_config(path)
    return model_footprint(cls, config, torch.float32, EngineConfig())


def policy_options(policy: str, path, tmp_path) -> dict:
    """Engine options that put some, not all, routed experts on the device under `policy`."""
    fp = footprint(path)
    room = fp.num_experts * len(fp.moe_layers) // 2 + 1
    if policy == "per-layer":
        return dict(gpu_experts_per_layer=fp.num_experts // 2)
    stats = tmp_path / "stats.json"
    stats.write_text(ExpertStats({layer: [(e * 5 + layer) % fp.num_experts for e in range(fp.num_experts)]
                                  for layer in fp.moe_layers}).to_json())
    return dict(gpu_memory_budget=fp.fixed_bytes + room * fp.expert_bytes, expert_placement=policy,
                expert_stats=str(stats))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_gives_the_reference_logits(tiny_checkpoints, tmp_path, family, policy):
    path = tiny_checkpoints(family)
    want = prompt_logits(load(path, expert_backend="torch").model)
    hybrid = load(path, expert_backend="torch", **policy_options(policy, path, tmp_path))
    assert isinstance(hybrid.experts, HybridExperts)
    placed = hybrid.experts.plan.num_gpu_experts
    assert 0 < placed < hybrid.experts.plan.footprint.num_experts * len(hybrid.model.moe_layers)
    torch.testing.assert_close(prompt_logits(hybrid.model), want, **FP32)


def test_native_cpu_part_gives_the_reference_logits(tiny_checkpoints):
    path = tiny_checkpoints("deepseek_v3")
    want = prompt_logits(load(path, expert_backend="torch").model)
    hybrid = load(path, expert_backend="native", expert_format="bf16", cpu_threads=1, gpu_experts_per_layer=5)
    # the native engine computes in bf16: the bf16 row of the models' tolerance table
    torch.testing.assert_close(prompt_logits(hybrid.model), want, atol=5e-2, rtol=5e-2)


def test_a_budget_too_small_for_the_model_is_an_error_before_loading(tiny_checkpoints):
    from hybridmoe.errors import HybridMoEError

    path = tiny_checkpoints("qwen3_moe")
    needed = footprint(path).fixed_bytes
    with pytest.raises(HybridMoEError, match=f"need .*\\({needed} bytes\\)"):
        load(path, expert_backend="torch", gpu_memory_budget=needed // 2)
