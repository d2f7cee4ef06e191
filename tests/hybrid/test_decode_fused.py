"""The decode step's fused operations as the CPU runs them (their torch versions, the reference the
Triton kernels are held to in tests/device/test_decode_fused_cuda.py): RMSNorm with its residual add,
the hybrid split of a step's slots and the sum of its partial outputs, and the model's switch.

T tokens, E experts, K experts per token, H hidden.
"""

import pytest
import torch

from hybridmoe.checkpoint.presets import model_config
from hybridmoe.experts.decode_fused import (
    add_parts,
    route_split,
    split_slots,
    sum_parts,
)
from hybridmoe.experts.hybrid import HybridExperts, TorchCpuLayer
from hybridmoe.experts.placement import Footprint, PlacementPlan
from hybridmoe.layers.norm import RMSNorm
from hybridmoe.layers.router import softmax_topk
from hybridmoe.models.qwen_moe import Qwen3MoeForCausalLM

E, K = 8, 3
ON_GPU = torch.tensor([True, False, True, False, False, True, False, False])  # 5 on the CPU
LOCAL = torch.tensor([0, 0, 1, 1, 2, 2, 3, 4])  # global id -> index among its side's experts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_a_residual_normalizes_the_rounded_sum_and_returns_it(dtype):
    g = torch.Generator().manual_seed(0)
    n = RMSNorm(64)
    n.weight.data = (1 + 0.1 * torch.randn(64, generator=g)).to(dtype)
    x, res = (torch.randn(3, 64, generator=g).to(dtype) for _ in range(2))
    out, total = n(x, residual=res)
    assert torch.equal(total, res + x)
    assert torch.equal(out, n(res + x))


@pytest.mark.parametrize("T", [1, 4])
def test_split_slots_sends_each_slot_to_its_experts_side(T):
    g = torch.Generator().manual_seed(T)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[0] = torch.tensor([0, 2, 5])  # every expert on the GPU: its CPU slots are all padding
    w = torch.rand(T, K, generator=g)
    gid, mask, cid, cw = split_slots(ids, w, ON_GPU, LOCAL, K)
    assert torch.equal(mask, ON_GPU[ids])
    assert torch.equal(gid[mask], LOCAL[ids][mask])
    assert cid.shape == cw.shape == (T, K) and cid.dtype == torch.int64 and cw.dtype == torch.float32
    for t in range(T):
        want = sorted((int(LOCAL[e]), float(x)) for e, x, m in zip(ids[t], w[t], mask[t]) if not m)
        assert sorted((int(e), float(x)) for e, x in zip(cid[t], cw[t]) if x != 0) == want
        if t == 0 and T > 1:  # padding borrows an expert the batch reads anyway
            assert set(cid[t].tolist()) <= set(cid[1:][cw[1:] != 0].tolist())


def test_split_slots_without_cpu_experts_gives_no_cpu_slots():
    ids = torch.tensor([[0, 2, 5]])
    _, mask, cid, cw = split_slots(ids, torch.rand(1, K), ON_GPU, LOCAL, 0)
    assert bool(mask.all()) and cid is None and cw is None


def test_route_split_is_the_routers_top_k_then_the_split():
    logits = torch.randn(4, E, generator=torch.Generator().manual_seed(1))
    w, ids, split = route_split(logits, K, True, ON_GPU, LOCAL, K)
    want_w, want_ids = softmax_topk(logits, K, True)
    assert torch.equal(ids, want_ids) and torch.equal(w, want_w)
    for got, want in zip(split, split_slots(ids, w, ON_GPU, LOCAL, K)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("deferred", [1, 2])
def test_route_split_with_deferral_splits_the_first_columns_and_split_slots_a_part_the_others(deferred):
    logits = torch.randn(4, E, generator=torch.Generator().manual_seed(2))
    w, ids, now = route_split(logits, K, True, ON_GPU, LOCAL, K - deferred, deferred=deferred)
    later = split_slots(ids, w, ON_GPU, LOCAL, deferred, part=(K - deferred, K))
    want_w, want_ids = softmax_topk(logits, K, True)
    assert torch.equal(ids, want_ids) and torch.equal(w, want_w)
    keep = K - deferred
    for (gid, mask, cid, cw), cols in ((now, slice(0, keep)), (later, slice(keep, K))):
        inside = torch.zeros(K, dtype=torch.bool)
        inside[cols] = True
        assert torch.equal(mask, ON_GPU[ids] & inside)  # [T, K]: the other part's columns off
        assert torch.equal(gid[mask], LOCAL[ids][mask])
        _, _, want_cid, want_cw = split_slots(ids[:, cols], w[:, cols], ON_GPU, LOCAL, cid.shape[1])
        assert torch.equal(cid, want_cid) and torch.equal(cw, want_cw)


@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32])
def test_route_split_staged_writes_the_cpu_rows_into_the_given_buffers(ids_dtype):
    g = torch.Generator().manual_seed(3)
    logits, x = torch.randn(4, E, generator=g), torch.randn(4, 16, generator=g).to(torch.bfloat16)
    x_dst, ids_dst, w_dst = torch.zeros(4, 16), torch.zeros(4, K, dtype=ids_dtype), torch.zeros(4, K)
    w, ids, (gid, mask, cid, cw) = route_split(logits, K, True, ON_GPU, LOCAL, K, stage=(x, x_dst, ids_dst, w_dst))
    want = route_split(logits, K, True, ON_GPU, LOCAL, K)
    assert torch.equal(ids, want[1]) and torch.equal(w, want[0])
    assert cid is ids_dst and cw is w_dst  # the staging buffers are the CPU slots
    assert torch.equal(ids_dst, want[2][2].to(ids_dtype)) and torch.equal(w_dst, want[2][3])
    assert torch.equal(x_dst, x.float())  # in the staging buffer's dtype
    assert torch.equal(gid, want[2][0]) and torch.equal(mask, want[2][1])


@pytest.mark.parametrize("deferred", [1, 2])
def test_route_split_with_later_stages_the_deferred_part_too(deferred):
    g = torch.Generator().manual_seed(4)
    logits, x = torch.randn(4, E, generator=g), torch.randn(4, 16, generator=g)
    keep = K - deferred
    stage = (x, torch.zeros(4, 16), torch.zeros(4, keep, dtype=torch.int64), torch.zeros(4, keep))
    ids2, w2 = torch.zeros(4, deferred, dtype=torch.int32), torch.zeros(4, deferred)
    w, ids, now, later = route_split(logits, K, True, ON_GPU, LOCAL, keep, deferred=deferred, stage=stage,
                                     later=(deferred, ids2, w2, None))
    want = route_split(logits, K, True, ON_GPU, LOCAL, keep, deferred=deferred)
    assert torch.equal(ids, want[1]) and torch.equal(w, want[0])
    for got, exp in zip(now, want[2]):
        assert torch.equal(got, exp)
    assert later[2] is ids2 and later[3] is w2
    for got, exp in zip(later, split_slots(ids, w, ON_GPU, LOCAL, deferred, part=(keep, K))):
        assert torch.equal(got.to(exp.dtype), exp)


def test_route_split_staging_and_flags_errors():
    logits, x = torch.randn(1, E), torch.randn(1, 16)
    with pytest.raises(ValueError, match="width"):
        route_split(logits, K, True, ON_GPU, LOCAL, 0, stage=(x, x, torch.zeros(1, 0), torch.zeros(1, 0)))
    stage = (x, torch.zeros(1, 16), torch.zeros(1, K, dtype=torch.int64), torch.zeros(1, K))
    with pytest.raises(ValueError, match="signal needs the Triton kernel"):
        route_split(logits, K, True, ON_GPU, LOCAL, K, stage=stage, signal=(torch.zeros(1), torch.zeros(1)))
    with pytest.raises(ValueError, match="later needs stage, deferred experts"):
        route_split(logits, K, True, ON_GPU, LOCAL, K, stage=stage,
                    later=(1, torch.zeros(1, 1), torch.zeros(1, 1), None))
    with pytest.raises(ValueError, match="done needs the Triton kernel"):
        sum_parts([x, x], torch.float32, done=torch.zeros(1, dtype=torch.int32))


def test_sum_parts_adds_in_float32_and_rounds_once():
    a = torch.tensor([[256.0, 1.0]], dtype=torch.bfloat16)
    b = torch.tensor([[1 + 2.0 ** -8, 2.0 ** -9]])
    # 257.0039 rounds up to 258; b rounded to bfloat16 first (1.0) would give 256 + 1 -> 256 (ties to even)
    assert torch.equal(sum_parts([a, b], torch.bfloat16), torch.tensor([[258.0, 1.0]], dtype=torch.bfloat16))
    assert torch.equal(sum_parts([a, b], torch.float32), a.float() + b)
    c = torch.tensor([[2.0 ** -9, 2.0 ** -9]])
    # four parts, one rounding: 1 + 3 * 2^-9 rounds up to 1 + 2^-7, where each 2^-9 added and rounded alone vanishes
    assert torch.equal(sum_parts([a, b, c, c], torch.bfloat16),
                       torch.tensor([[258.0, 1 + 2.0 ** -7]], dtype=torch.bfloat16))
    assert torch.equal(sum_parts([a, b, c], torch.float32), a.float() + b + c)


def test_add_parts_adds_the_rounded_sum_of_the_parts_to_the_residual():
    h = torch.tensor([[1.0, -3.0]], dtype=torch.bfloat16)
    a = torch.tensor([[256.0, 1.0]], dtype=torch.bfloat16)
    b = torch.tensor([[1 + 2.0 ** -8, 2.0 ** -9]])
    # the parts' sum rounds to bfloat16 first (258, as sum_parts), then the residual add rounds again
    assert torch.equal(add_parts(h, [a, b]), h + sum_parts([a, b], torch.bfloat16))
    assert torch.equal(add_parts(h, [a, b]), torch.tensor([[260.0, -2.0]], dtype=torch.bfloat16))
    assert torch.equal(add_parts(h, [b]), h + b.to(torch.bfloat16))


def test_fuse_decode_kernels_switches_every_fused_part():
    config = Qwen3MoeForCausalLM.make_config(model_config("qwen3_moe", "tiny"))
    fp = Footprint(0, 0, 0, 0, [0, 1], config.num_experts, config.num_experts_per_tok, config.hidden_size,
                   config.moe_intermediate_size)
    experts = HybridExperts(PlacementPlan(fp, None, "test", {}), "cpu", TorchCpuLayer, num_layers=2)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config, experts)
    parts = [m for m in [*model.modules(), model.experts] if hasattr(m, "fused")]
    assert {type(m).__name__ for m in parts} == {"RMSNorm", "Attention", "SparseMoeBlock", "HybridExperts"}
    model.fuse_decode_kernels(False)
    assert not any(m.fused for m in parts)
    model.fuse_decode_kernels(True)
    assert all(m.fused for m in parts)
