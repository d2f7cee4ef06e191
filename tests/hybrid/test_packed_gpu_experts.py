"""GPU experts kept packed (experts/packed_gpu.py): the same codes as the CPU engine's, their bytes in the
placement, the choice of when to pack, and a layer that computes the same wherever its experts are placed.

Here the CPU stands in for the GPU (the torch paths dequantize the packed experts); the Triton kernels that
read them packed are tested on the GPU host (tests/device/test_packed_gpu_experts_cuda.py).
E experts, H hidden, I intermediate, K experts per token, T tokens.
"""

import pytest
import torch
import torch.nn.functional as F

from hybridmoe.config import EngineConfig
from hybridmoe.experts import packed_gpu
from hybridmoe.experts.cpu_experts import CpuExperts
from hybridmoe.experts.expert_bytes import packed_expert_bytes
from hybridmoe.experts.gpu_experts import fixed_shape_experts, weighted_experts
from hybridmoe.experts.hybrid import HybridExperts
from hybridmoe.experts.packed_gpu import pack_gpu_experts, packed_gpu_format
from hybridmoe.experts.placement import (
    Footprint,
    PlacementPlan,
    model_footprint,
    plan_placement,
)
from hybridmoe.models.registry import load_config

E, H, I, K = 6, 64, 96, 2
FORMATS = [("int4", 32, False), ("int4", 32, True), ("int8", 128, False)]


def experts(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, I, H, generator=g) / 8, torch.randn(E, I, H, generator=g) / 8,
            torch.randn(E, H, I, generator=g) / 6)


def packer(fmt: str, group: int, zero_points: bool):
    return lambda g, u, d: CpuExperts(g, u, d, format=fmt, group_size=group, zero_points=zero_points, threads=1)


@pytest.mark.parametrize("fmt,group,zero_points", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_matrices_hold_the_cpu_engines_codes(fmt, group, zero_points, dtype):
    weights = experts()
    cpu = packer(fmt, group, zero_points)(*weights)
    packed = pack_gpu_experts(cpu, torch.device("cpu"), dtype)
    for m, mat in enumerate(packed):
        assert mat.shape == tuple(weights[m].shape) and mat.format == fmt
        want = torch.stack([cpu.dequantized(e)[m] for e in range(E)]).to(dtype)
        assert torch.equal(mat.dense(), want)
    held = sum(t.numel() * t.element_size() for mat in packed for t in (mat.codes, mat.scale, mat.zero) if t is not None)
    assert held == E * packed_expert_bytes(fmt, H, I, group, zero_points) == cpu.packed_bytes


@pytest.mark.parametrize("fmt,group,zero_points", FORMATS)
def test_the_codes_of_a_layer_split_over_numa_nodes_are_those_of_one_node(fmt, group, zero_points):
    from hybridmoe.experts.packed_torch import PackedLayout

    weights = experts(5)
    layouts = []
    for numa in (1, 2):
        state = CpuExperts(*weights, format=fmt, group_size=group, zero_points=zero_points, threads=2,
                           numa_nodes=numa).packed_state()
        buffers = {n: torch.as_tensor(b).view(torch.uint8).reshape(-1) for n, b in state["buffers"].items()}
        layout = PackedLayout(state)
        layouts.append([layout.codes(mat, buffers, torch.tensor([4, 0, 2])) for mat in layout.matrices])
    for one, two in zip(*layouts):
        assert one[0].shape == two[0].shape and one[0].shape[1:] in ((I, H), (H, I))
        for a, b in zip(one, two):
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b))


@pytest.mark.parametrize("fmt,group,zero_points", FORMATS)
@pytest.mark.parametrize("T", [1, 5])
def test_the_gpu_share_of_packed_experts_is_that_of_their_dequantized_weights(fmt, group, zero_points, T):
    packed = pack_gpu_experts(packer(fmt, group, zero_points)(*experts()), torch.device("cpu"), torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.randint(0, E, (T, K), generator=g)
    w, mask = torch.rand(T, K, generator=g), torch.rand(T, K, generator=g) > 0.3
    dense = tuple(m.dense() for m in packed)
    want = weighted_experts(x, *dense, ids, w, mask, F.silu)
    assert torch.equal(weighted_experts(x, *packed, ids, w, mask, F.silu), want)
    torch.testing.assert_close(fixed_shape_experts(x, *packed, ids, w, mask, F.silu),
                               fixed_shape_experts(x, *dense, ids, w, mask, F.silu), atol=0, rtol=0)


@pytest.mark.parametrize("gpu_ids", [[], [1, 4], list(range(E))])
def test_a_layer_computes_the_same_wherever_its_packed_experts_are_placed(gpu_ids):
    """int4 experts: on the "GPU" packed as on the CPU, so moving experts between them changes nothing
    but the rounding of the sums (bf16 kernels against torch on the same dequantized weights)."""
    weights = experts(2)
    fp = Footprint(0, 0, 0, 1, [0], E, K, H, I)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, H, generator=g).bfloat16()
    w, ids = torch.randn(4, E, generator=g).softmax(-1).topk(K, dim=-1)
    all_cpu = HybridExperts(PlacementPlan(fp, None, "test", {}), "cpu", packer("int4", 32, False))
    all_cpu.set_layer(0, *(t.bfloat16() for t in weights))
    split = HybridExperts(PlacementPlan(fp, None, "test", {0: gpu_ids} if gpu_ids else {}), "cpu",
                          packer("int4", 32, False), gpu_format="int4")
    split.set_layer(0, *(t.bfloat16() for t in weights))
    if gpu_ids:
        assert all(isinstance(m, packed_gpu.PackedMatrix) for m in split._layers[0].gpu_weights)
    torch.testing.assert_close(split.forward(0, x, ids, w).float(), all_cpu.forward(0, x, ids, w).float(),
                               atol=2e-2, rtol=2e-2)


def test_set_layer_experts_packs_the_gpu_experts_as_set_layer_does():
    weights = tuple(t.bfloat16() for t in experts(4))
    fp = Footprint(0, 0, 0, 1, [0], E, K, H, I)
    plan = PlacementPlan(fp, None, "test", {0: [0, 3, 5]})
    stacked = HybridExperts(plan, "cpu", packer("int4", 32, False), gpu_format="int4")
    stacked.set_layer(0, *weights)
    one_by_one = HybridExperts(plan, "cpu", packer("int4", 32, False), gpu_format="int4")
    one_by_one.set_layer_experts(0, ((weights[0][e], weights[1][e], weights[2][e]) for e in range(E)), E)
    for a, b in zip(stacked._layers[0].gpu_weights, one_by_one._layers[0].gpu_weights):
        assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale) and a.shape == b.shape == (3, *a.shape[1:])


def test_experts_are_packed_on_the_gpu_only_where_its_kernels_read_them(monkeypatch):
    monkeypatch.setattr(packed_gpu, "HAVE_TRITON", True)
    assert packed_gpu_format("native", "int4", "cuda", torch.bfloat16) == "int4"
    assert packed_gpu_format("native", "int8", "cuda:0", torch.float16) == "int8"
    assert packed_gpu_format("native", "int4", "cuda", torch.bfloat16, enabled=False) is None
    assert packed_gpu_format("native", "bf16", "cuda", torch.bfloat16) is None
    assert packed_gpu_format("torch", "int4", "cuda", torch.bfloat16) is None
    assert packed_gpu_format("native", "int4", "cpu", torch.bfloat16) is None
    assert packed_gpu_format("native", "int4", "cuda", torch.float32) is None  # float32 models stay exact
    monkeypatch.setattr(packed_gpu, "HAVE_TRITON", False)
    assert packed_gpu_format("native", "int4", "cuda", torch.bfloat16) is None


def test_the_budget_holds_about_four_times_as_many_int4_experts_packed(monkeypatch, tmp_path):
    from hybridmoe.checkpoint.make import make_checkpoint

    make_checkpoint("qwen3_moe", "tiny", tmp_path, dtype="bf16", seed=0, progress=False)
    cls, config = load_config(tmp_path)
    monkeypatch.setattr(packed_gpu, "HAVE_TRITON", True)
    options = dict(device="cuda", expert_backend="native", expert_format="int4", expert_group_size=32,
                   max_num_seqs=1, max_model_len=64)
    dense = model_footprint(cls, config, torch.bfloat16, EngineConfig(gpu_experts_packed=False, **options))
    packed = model_footprint(cls, config, torch.bfloat16, EngineConfig(**options))
    inter, hidden = packed.moe_intermediate_size, packed.hidden_size
    assert dense.gpu_format is None and dense.expert_bytes == 3 * inter * hidden * 2
    assert packed.gpu_format == "int4" and packed.expert_bytes == packed_expert_bytes("int4", hidden, inter, 32, False)
    budget = packed.fixed_bytes + 10 * dense.expert_bytes
    plans = [plan_placement(fp, EngineConfig(gpu_memory_budget=budget, **options)) for fp in (dense, packed)]
    assert plans[0].num_gpu_experts == 10  # 5 per layer
    assert plans[1].num_gpu_experts == 16  # 3.2x as many fit: every expert of both MoE layers
    assert all(plan.gpu_bytes <= budget for plan in plans)
    assert "packed int4" in plans[1].describe() and "packed" not in plans[0].describe()
