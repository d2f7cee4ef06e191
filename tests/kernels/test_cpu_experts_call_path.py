"""The per-call path: decode-sized grouping (sorted, not counted), the GEMM item list reused from
call to call and layer to layer, and forward()/submit() into a caller's `out`."""

import pytest
import torch

from hybridmoe import CpuExperts
from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.torch_ref import ref_moe
from hybridmoe.experts.tuning import EngineTuning

E, H, I = 16, 96, 64


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_decode_sized_calls_with_shared_experts(make_weights, make_routing, kernel_bound, rel_err,
                                                dequantized_layer, fmt, isa):
    # K = 6 of 8 experts: tokens share experts, so experts get 1..T tokens (uneven runs).
    experts = CpuExperts(*make_weights(E, H, I), format=fmt, group_size=32, threads=2, isa=isa)
    deq = dequantized_layer(experts)
    for T in (1, 2, 3, 4, 10):  # T * K up to 64 pairs are grouped by sorting, 10 tokens by counting
        x, ids, weights = make_routing(T, H, 6, range(3, 11), seed=T)
        out = experts.forward(x, ids, weights)
        assert rel_err(out, ref_moe(x, *deq, ids, weights)) < kernel_bound(fmt, isa)


def test_sorted_and_counted_grouping_agree(make_weights, make_routing):
    # 8 tokens x 8 experts = 64 pairs (sorted) and the same tokens plus one (72 pairs, counted):
    # the shared tokens' rows come out the same, bit for bit.
    experts = CpuExperts(*make_weights(E, H, I), format="int8", threads=2)
    x, ids, weights = make_routing(9, H, 8, range(E))
    few = experts.forward(x[:8], ids[:8], weights[:8])
    many = experts.forward(x, ids, weights)
    assert torch.equal(few, many[:8])


def test_item_lists_are_not_mixed_up_between_layers(make_weights, make_routing):
    # Layers of two shapes, called in turn with varying numbers of active experts, on one thread
    # (whose item list each call either reuses or rebuilds): every repeat gives the first result.
    shapes = [(E, H, I, "int4"), (8, 64, 160, "bf16")]
    layers = [CpuExperts(*make_weights(e, h, i, seed=e), format=fmt, group_size=32, threads=2)
              for e, h, i, fmt in shapes]
    calls = [(layer, make_routing(T, h, K, range(e), seed=T))
             for layer, (e, h, _, _) in zip(layers, shapes) for T, K in ((1, 4), (3, 4), (1, 2))]
    expected = [layer.forward(*routing) for layer, routing in calls]
    for _ in range(2):
        for (layer, routing), want in zip(calls[::-1], expected[::-1]):
            assert torch.equal(layer.forward(*routing), want)


def test_forward_and_submit_write_into_out(make_weights, make_routing):
    experts = CpuExperts(*make_weights(E, H, I), threads=2)
    x, ids, weights = make_routing(3, H, 2, range(E))
    expected = experts.forward(x, ids, weights)
    out = torch.full_like(x, float("nan"))
    assert experts.forward(x, ids, weights, out=out) is out
    assert torch.equal(out, expected)
    out.fill_(float("nan"))
    experts.submit(x, ids, weights, out=out)
    assert experts.wait() is out
    assert torch.equal(out, expected)


@pytest.mark.parametrize("out,message", [
    (lambda x: x.double(), "out must be float32"),
    (lambda x: x[:2].clone(), "out has shape"),
    (lambda x: torch.empty(x.shape[1], x.shape[0]).t(), "out must be contiguous"),
])
def test_bad_out_is_refused(make_weights, make_routing, out, message):
    experts = CpuExperts(*make_weights(E, H, I), threads=2)
    x, ids, weights = make_routing(3, H, 2, range(E))
    with pytest.raises(HybridMoEError, match=message):
        experts.forward(x, ids, weights, out=out(x))


@pytest.mark.parametrize("position", range(3))
def test_inputs_that_are_not_tensors_are_refused(make_weights, make_routing, position):
    experts = CpuExperts(*make_weights(E, H, I), threads=2)
    args = list(make_routing(3, H, 2, range(E)))
    args[position] = args[position].tolist()
    with pytest.raises(HybridMoEError):
        experts.forward(*args, out=torch.empty(3, H))


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_schedule_knobs_give_the_same_bits(make_weights, make_routing, fmt, isa):
    # Decode calls convert x inside the run (gate/up items wait for it); 40 tokens convert before it.
    experts = CpuExperts(*make_weights(E, H, I), format=fmt, group_size=32, threads=3, isa=isa)
    plain = dict(early_start=False, padded_counters=False)
    for T in (1, 4, 40):
        x, ids, weights = make_routing(T, H, 6, range(E), seed=T)
        experts.tune(EngineTuning(**plain))
        expected = experts.forward(x, ids, weights)
        for knobs in ({"early_start": True}, {"padded_counters": True}, {"early_start": True, "padded_counters": True}):
            experts.tune(EngineTuning(**{**plain, **knobs}))
            assert torch.equal(experts.forward(x, ids, weights), expected)
            experts.submit(x, ids, weights)
            assert torch.equal(experts.wait(), expected)


def test_early_start_trace_records_the_wait_for_x(make_weights, make_routing):
    experts = CpuExperts(*make_weights(E, H, I), threads=2)
    experts.tune(EngineTuning(early_start=True))
    experts.trace(1)
    experts.forward(*make_routing(1, H, 4, range(E)))
    rec = experts.take_trace()[0]
    gate_up = rec["items"][rec["items"][:, 1] == 0]
    assert rec["grouped_ns"] <= rec["acts_ns"] <= rec["items_ns"] <= rec["gemm_end_ns"]
    assert (gate_up[:, 8] >= 0).all() and (gate_up[:, 8] <= gate_up[:, 7] - gate_up[:, 6]).all()
