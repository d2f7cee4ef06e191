"""Placement plans from tensor sizes alone: real-shape presets, every policy, budgets from tight to roomy."""

import pytest
import torch

from hybridmoe.checkpoint.presets import model_config
from hybridmoe.checkpoint.tensors import tensor_specs
from hybridmoe.config import EngineConfig
from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.placement import ExpertStats, model_footprint, plan_placement
from hybridmoe.models.registry import get_model_class

PRESETS = [("qwen3_moe", "qwen3-30b-a3b"), ("deepseek_v3", "deepseek-v3"), ("deepseek_v2", "deepseek-v2-lite"),
           ("mixtral", "mixtral-8x7b"), ("qwen2_moe", "qwen1.5-moe-a2.7b")]
GiB = 1 << 30


def footprint(arch, preset, **options):
    raw = model_config(arch, preset)
    cls = get_model_class(raw["architectures"][0])
    return raw, cls, model_footprint(cls, cls.make_config(raw), torch.bfloat16, EngineConfig(**options))


def skewed_stats(fp) -> ExpertStats:
    """Counts that differ per layer and per expert, so every policy has a clear hottest order."""
    E = fp.num_experts
    return ExpertStats({layer: [(e * 7 + layer * 3) % E + 1 for e in range(E)] for layer in fp.moe_layers})


@pytest.mark.parametrize("arch,preset", PRESETS)
def test_non_expert_bytes_are_the_checkpoint_tensors_the_gpu_holds(arch, preset):
    raw, cls, fp = footprint(arch, preset)
    specs = [s for s in tensor_specs(raw) if not cls.expert_pattern.fullmatch(s.name)]
    # DeepSeek keeps its routers in float32 whatever the model dtype (as transformers does)
    router = [s for s in specs if arch.startswith("deepseek") and ".mlp.gate." in s.name]
    expected = sum(s.nbytes for s in specs) + sum(s.numel * (4 - s.dtype.itemsize) for s in router)
    assert fp.non_expert_bytes == expected


def test_the_kv_cache_holds_max_num_seqs_x_4096_tokens_or_its_budget():
    per_token = 48 * 2 * 4 * 128 * 2  # layers, k+v, kv heads, head dim, bf16
    _, _, fp = footprint("qwen3_moe", "qwen3-30b-a3b", max_num_seqs=3, max_model_len=1000)
    assert fp.kv_cache_bytes == (3 * 4096 // 64 + 1) * 64 * per_token  # blocks of 64 and the scratch block
    _, _, long = footprint("qwen3_moe", "qwen3-30b-a3b", max_num_seqs=1, max_model_len=32768)
    assert long.kv_cache_bytes == (32768 // 64 + 1) * 64 * per_token  # one max_model_len sequence is more
    _, _, budget = footprint("qwen3_moe", "qwen3-30b-a3b", kv_cache_budget="1GiB")
    assert budget.kv_cache_bytes == ((1 << 30) // (64 * per_token) + 1) * 64 * per_token
    _, _, mla = footprint("deepseek_v3", "deepseek-v3", max_num_seqs=2, max_model_len=512)
    assert mla.kv_cache_bytes == (2 * 4096 // 64 + 1) * 64 * 61 * (512 + 64) * 2  # a latent + rope key per layer


@pytest.mark.parametrize("arch,preset", PRESETS)
@pytest.mark.parametrize("policy", ["uniform", "frequency", "front-loading", "per-layer"])
def test_a_plan_never_exceeds_its_budget(arch, preset, policy):
    _, _, fp = footprint(arch, preset)
    all_experts = fp.num_experts * len(fp.moe_layers)
    stats = skewed_stats(fp)
    budgets = [fp.fixed_bytes, fp.fixed_bytes + fp.expert_bytes - 1, 16 * GiB, 80 * GiB,
               fp.fixed_bytes + all_experts * fp.expert_bytes // 3, fp.fixed_bytes + all_experts * fp.expert_bytes + 1]
    for budget in [b for b in budgets if b >= fp.fixed_bytes]:
        room = (budget - fp.fixed_bytes) // fp.expert_bytes
        options = dict(gpu_memory_budget=budget)
        if policy == "per-layer":
            options["gpu_experts_per_layer"] = min(fp.num_experts, room // len(fp.moe_layers))
        else:
            options["expert_placement"] = policy
        plan = plan_placement(fp, EngineConfig(**options), stats)
        assert plan.gpu_bytes <= budget
        assert all(len(set(ids)) == len(ids) <= fp.num_experts for ids in plan.gpu_experts.values())
        # the budget is used: what is left cannot hold another expert (another per layer, for equal counts)
        per_layer = policy in ("uniform", "per-layer")
        left = min(room, all_experts) - plan.num_gpu_experts
        assert left < (len(fp.moe_layers) if per_layer else 1) or plan.num_gpu_experts == all_experts


def test_too_small_a_budget_says_how_much_is_needed():
    _, _, fp = footprint("qwen3_moe", "qwen3-30b-a3b")
    with pytest.raises(HybridMoEError, match=f"too small.*need .*{fp.fixed_bytes} bytes.*--gpu-memory-budget"):
        plan_placement(fp, EngineConfig(gpu_memory_budget=fp.fixed_bytes - 1))


def test_explicit_experts_per_layer_must_fit_the_budget_and_the_layer():
    _, _, fp = footprint("qwen3_moe", "qwen3-30b-a3b")
    budget = fp.fixed_bytes + 10 * len(fp.moe_layers) * fp.expert_bytes
    assert plan_placement(fp, EngineConfig(gpu_memory_budget=budget, gpu_experts_per_layer=10)).num_gpu_experts == 480
    with pytest.raises(HybridMoEError, match="room for 10 per layer"):
        plan_placement(fp, EngineConfig(gpu_memory_budget=budget, gpu_experts_per_layer=11))
    with pytest.raises(HybridMoEError, match="exceeds the 128 routed experts"):
        plan_placement(fp, EngineConfig(gpu_experts_per_layer=129))


def test_policies_choose_hot_experts_and_layers_as_documented():
    _, _, fp = footprint("deepseek_v2", "deepseek-v2-lite")
    stats = skewed_stats(fp)
    first, second = fp.moe_layers[:2]
    room = fp.num_experts + 5
    budget = fp.fixed_bytes + room * fp.expert_bytes
    front = plan_placement(fp, EngineConfig(gpu_memory_budget=budget, expert_placement="front-loading"), stats)
    assert len(front.on_gpu(first)) == fp.num_experts and len(front.on_gpu(second)) == 5
    assert set(front.on_gpu(second)) == set(stats.hottest(second)[:5])
    uniform = plan_placement(fp, EngineConfig(gpu_memory_budget=budget, expert_placement="uniform"), stats)
    n = room // len(fp.moe_layers)
    assert all(set(uniform.on_gpu(layer)) == set(stats.hottest(layer)[:n]) for layer in fp.moe_layers)
    freq = plan_placement(fp, EngineConfig(gpu_memory_budget=budget, expert_placement="frequency"), stats)
    chosen = [stats.counts[layer][e] for layer, ids in freq.gpu_experts.items() for e in ids]
    left_out = [stats.counts[layer][e] for layer in fp.moe_layers for e in freq.on_cpu(layer)]
    assert len(chosen) == room and min(chosen) >= max(left_out)


def test_frequency_needs_statistics_of_this_model(tmp_path):
    _, _, fp = footprint("qwen3_moe", "qwen3-30b-a3b")
    with pytest.raises(HybridMoEError, match="profile-experts"):
        plan_placement(fp, EngineConfig(gpu_memory_budget=80 * GiB, expert_placement="frequency"))
    other = tmp_path / "stats.json"
    other.write_text(ExpertStats({0: [1] * 8}).to_json())
    with pytest.raises(HybridMoEError, match="another model"):
        ExpertStats.load(other, fp.moe_layers, fp.num_experts)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(HybridMoEError, match="not an expert statistics file"):
        ExpertStats.load(tmp_path / "bad.json", fp.moe_layers, fp.num_experts)


@pytest.mark.parametrize("text,expected", [("16GiB", 16 * GiB), ("500MiB", 500 << 20), ("2.5GB", 2_500_000_000),
                                           ("1073741824", GiB), (4096, 4096)])
def test_budget_sizes_are_read_as_written(text, expected):
    assert EngineConfig(gpu_memory_budget=text).gpu_memory_budget == expected


@pytest.mark.parametrize("text", ["16 GiBs", "lots", "-3GiB"])
def test_unreadable_budget_is_a_clear_error(text):
    with pytest.raises(HybridMoEError, match="cannot read"):
        EngineConfig(gpu_memory_budget=text)
