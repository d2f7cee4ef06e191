"""CpuExperts.trace / take_trace: the records of a traced call are complete and consistent.

Shapes: T tokens, K experts per token, E experts, H hidden, I expert intermediate size.
Blocks are 32 output rows: gate/up have ceil(I / 32) per expert, down ceil(H / 32), split
over the numa_nodes slices.
"""

from dataclasses import replace

import pytest
import torch

from hybridmoe import CpuExperts
from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.cpu_experts import _native
from hybridmoe.experts.tuning import EngineTuning

E, H, I, K = 8, 160, 96, 3
BLOCK = 32
# items columns (CpuExperts.take_trace)
WORKER, DOWN, EXPERT, SLICE, B0, B1, START, END, WAIT, CONVERT, DEFERRED = range(11)


def slice_blocks(rows, slices):
    """Blocks of each slice: the engine cuts a matrix's blocks evenly over the slices."""
    blocks = -(-rows // BLOCK)
    return [blocks * (s + 1) // slices - blocks * s // slices for s in range(slices)]


def check_call(rec, ids, threads, slices):
    items = rec["items"]
    touched = sorted(set(ids.flatten().tolist()))
    assert (rec["T"], rec["K"], rec["A"]) == (ids.shape[0], K, len(touched))

    # Every block of every touched expert, in both matrices and every slice, exactly once.
    for down, rows in ((0, I), (1, H)):
        for s, nb in enumerate(slice_blocks(rows, slices)):
            for e in touched:
                mine = items[(items[:, DOWN] == down) & (items[:, EXPERT] == e) & (items[:, SLICE] == s)]
                covered = torch.zeros(nb, dtype=torch.int64)
                for b0, b1 in mine[:, [B0, B1]].tolist():
                    covered[b0:b1] += 1
                assert covered.tolist() == [1] * nb, (down, s, e)
    assert set(items[:, EXPERT].tolist()) == set(touched)

    # The phases in order, the items inside the GEMM run.
    phases = [rec[k] for k in ("call_ns", "entry_ns", "grouped_ns", "acts_ns", "items_ns")]
    assert phases == sorted(phases) and phases[0] > 0
    assert rec["items_ns"] <= items[:, START].min() and items[:, START].le(items[:, END]).all()
    assert (items[:, END] + items[:, CONVERT]).max() <= rec["gemm_end_ns"] <= rec["end_ns"]
    assert items[:, WORKER].ge(0).all() and items[:, WORKER].lt(threads).all()

    # A down item computes only after every gate/up item of its expert; exactly one gate/up
    # item per expert (the last to finish) converts h. Down items wait for h, gate/up items only
    # for x's rows (early_start: converted inside the run), within their own time.
    up, dn = items[items[:, DOWN] == 0], items[items[:, DOWN] == 1]
    for e in touched:
        assert (dn[dn[:, EXPERT] == e][:, [START, WAIT]].sum(1) >= up[up[:, EXPERT] == e][:, END].max()).all()
        assert int(up[up[:, EXPERT] == e][:, CONVERT].gt(0).sum()) == 1
    assert items[:, WAIT].ge(0).all() and items[:, WAIT].le(items[:, END] - items[:, START]).all()
    assert dn[:, CONVERT].ge(0).all()

    # Worker 0 (the caller or the driver) always joins; a worker joined before its first item.
    joins = rec["join_ns"]
    assert joins.shape == (threads,) and rec["slept"].shape == (threads,) and joins[0] > 0
    for w in range(threads):
        own = items[items[:, WORKER] == w]
        if len(own):
            assert 0 < joins[w] <= own[:, START].min()
        if joins[w]:
            assert rec["items_ns"] <= joins[w] <= rec["gemm_end_ns"]


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("numa_nodes", [1, 2])
def test_traced_calls_record_every_block_once_in_time_order(make_weights, make_routing, fmt, T, numa_nodes):
    experts = CpuExperts(*make_weights(E, H, I), format=fmt, group_size=32, threads=2, numa_nodes=numa_nodes)
    x, ids, weights = make_routing(T, H, K, range(E))
    expected = experts.forward(x, ids, weights)
    experts.trace(2)
    assert torch.equal(experts.forward(x, ids, weights), expected)
    experts.submit(x, ids, weights)
    assert torch.equal(experts.wait(), expected)
    records = experts.take_trace()
    assert len(records) == 2
    for rec in records:
        check_call(rec, ids, threads=2, slices=numa_nodes)
        assert rec["ready_ns"] == 0 and rec["items"][:, DEFERRED].eq(0).all()  # no deferral, no ready mark


@pytest.mark.parametrize("numa_nodes", [1, 2])
def test_a_traced_deferred_call_marks_its_deferred_items_and_when_out_was_ready(make_weights, numa_nodes):
    """One token, its last slot deferred to an expert no own slot uses: that expert's items (and only its) are
    marked deferred; out is ready after every own item's GEMM and before the call ends."""
    experts = CpuExperts(*make_weights(E, H, I), format="int4", group_size=32, threads=2, numa_nodes=numa_nodes)
    x = torch.randn(1, H)
    ids = torch.tensor([[0, 3, 5]])
    weights = torch.tensor([[0.5, 0.3, 0.2]])
    experts.trace(1)
    experts.forward_deferred(x, ids, weights, 1)
    rec = experts.take_trace()[0]
    check_call(rec, ids, threads=2, slices=numa_nodes)
    items = rec["items"]
    deferred = items[:, DEFERRED].bool()
    assert torch.equal(deferred, items[:, EXPERT] == 5)
    own = items[~deferred]
    assert own[:, END].max() <= rec["ready_ns"] <= rec["end_ns"]


def test_tracing_stops_after_its_calls_and_take_empties(make_weights, make_routing):
    experts = CpuExperts(*make_weights(E, H, I), threads=2)
    x, ids, weights = make_routing(2, H, K, range(E))
    experts.trace(1)
    for _ in range(3):
        experts.forward(x, ids, weights)
    assert len(experts.take_trace()) == 1
    assert experts.take_trace() == []
    experts.forward(x, ids, weights)
    assert experts.take_trace() == []


def test_trace_rejects_a_negative_count(make_weights):
    experts = CpuExperts(*make_weights(E, H, I), threads=1)
    with pytest.raises(HybridMoEError, match="trace takes"):
        experts.trace(-1)


@pytest.mark.parametrize("blocks", [1, 2, 8])
@pytest.mark.parametrize("tail_split", [False, True])
def test_item_blocks_change_the_items_not_the_result(make_weights, make_routing, blocks, tail_split):
    experts = CpuExperts(*make_weights(E, H, I), format="int4", group_size=32, threads=2)
    x, ids, weights = make_routing(5, H, K, range(E))
    expected = experts.forward(x, ids, weights)
    experts.tune(EngineTuning(item_blocks=blocks, tail_split=tail_split))
    experts.trace(1)
    assert torch.equal(experts.forward(x, ids, weights), expected)
    rec = experts.take_trace()[0]
    check_call(rec, ids, threads=2, slices=1)
    sizes = rec["items"][:, B1] - rec["items"][:, B0]
    assert sizes.max() == min(blocks, -(-H // BLOCK)) and sizes.le(blocks).all()
    # Split: the last items, about two blocks per thread (4 here), are down items of one block.
    if tail_split:
        assert sizes[-4:].eq(1).all() and rec["items"][-4:, DOWN].eq(1).all()


@pytest.mark.parametrize("T", [1, 3, 20])
def test_balanced_items_change_the_items_not_the_result(make_weights, make_routing, T):
    """Item sizes chosen by the rounds of gate/up items (balanced_items) or by 4 items per thread: the same result,
    and every item within 1 to 8 blocks."""
    experts = CpuExperts(*make_weights(E, H, I), format="int4", group_size=32, threads=2)
    x, ids, weights = make_routing(T, H, K, range(E))
    experts.tune(EngineTuning(balanced_items=False))
    expected = experts.forward(x, ids, weights)
    experts.tune(EngineTuning(balanced_items=True))
    experts.trace(1)
    assert torch.equal(experts.forward(x, ids, weights), expected)
    rec = experts.take_trace()[0]
    check_call(rec, ids, threads=2, slices=1)
    sizes = rec["items"][:, B1] - rec["items"][:, B0]
    assert sizes.ge(1).all() and sizes.le(8).all()


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
@pytest.mark.parametrize("inter, blocks, k, deferred, own_sizes, deferred_sizes", [
    # 3-block experts in one item each; 2 threads: whole items from the end until they cover 4 blocks
    (96, 3, 3, 0, [3] + [1] * 6, []),
    (96, 3, 3, 1, [1] * 6, [1] * 3),
    # 10-block experts in 5-block items: the last item alone covers 4 blocks
    (320, 5, 2, 0, [5] * 3 + [1] * 5, []),
    (320, 5, 3, 0, [5] * 5 + [1] * 5, []),
])
def test_gate_up_tail_cuts_each_sides_last_gate_up_items_to_one_block_and_not_the_result(
        make_weights, fmt, inter, blocks, k, deferred, own_sizes, deferred_sizes):
    """gate_up_tail: per side (own, then deferred experts) its last gate/up items, about two blocks per thread, are
    1-block items; the outputs are bit-identical (a gate/up item's rows do not depend on the item's extent)."""
    experts = CpuExperts(*make_weights(E, H, inter), format=fmt, group_size=32, threads=2)
    g = torch.Generator().manual_seed(1)
    x, ids, weights = torch.randn(1, H, generator=g), torch.randperm(E, generator=g)[:k][None], torch.rand(1, k)
    run = (lambda: experts.forward_deferred(x, ids, weights, deferred)) if deferred else (
        lambda: (experts.forward(x, ids, weights),))
    experts.tune(EngineTuning(item_blocks=blocks, gate_up_tail=False))
    expected = run()
    experts.tune(replace(experts.tuning, gate_up_tail=True))
    experts.trace(1)
    assert all(torch.equal(a, b) for a, b in zip(run(), expected))
    rec = experts.take_trace()[0]
    items = rec["items"]
    for side, sizes in ((0, own_sizes), (1, deferred_sizes)):
        up = items[(items[:, DOWN] == 0) & (items[:, DEFERRED] == side)]
        assert (up[:, B1] - up[:, B0]).tolist() == sizes


@pytest.mark.parametrize("nbytes", [0, 64, 1 << 20])
def test_item_prefetch_changes_nothing_but_timing(make_weights, make_routing, nbytes):
    experts = CpuExperts(*make_weights(E, H, I), format="int4", group_size=32, threads=2, numa_nodes=2)
    x, ids, weights = make_routing(3, H, K, range(E))
    expected = experts.forward(x, ids, weights)
    experts.tune(EngineTuning(item_prefetch=nbytes))
    experts.trace(1)
    assert torch.equal(experts.forward(x, ids, weights), expected)
    check_call(experts.take_trace()[0], ids, threads=2, slices=2)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("l1, l2", [(0, 0), (64, 0), (8192, 0), (0, 16384), (2048, 8192)])
def test_kernel_prefetch_changes_nothing_but_timing(make_weights, make_routing, fmt, l1, l2):
    experts = CpuExperts(*make_weights(E, H, I), format=fmt, group_size=32, threads=2)
    x, ids, weights = make_routing(5, H, K, range(E))
    expected = experts.forward(x, ids, weights)
    experts.tune(EngineTuning(kernel_prefetch_l1=l1, kernel_prefetch_l2=l2))
    assert torch.equal(experts.forward(x, ids, weights), expected)


@pytest.mark.parametrize("knob", ["item_blocks", "item_prefetch", "kernel_prefetch_l1", "kernel_prefetch_l2"])
def test_tuning_sizes_must_not_be_negative(make_weights, knob):
    with pytest.raises(HybridMoEError, match=knob):
        EngineTuning(**{knob: -1})
    # the native boundary checks them too
    experts = CpuExperts(*make_weights(E, H, I), threads=1)
    native = _native().MoeTuning()
    setattr(native, knob, -1)
    with pytest.raises(ValueError, match=f"{knob} must be >= 0"):
        experts._engine.tuning = native


@pytest.mark.parametrize("T", [1, 5])
def test_combine_after_the_run_gives_the_same_output(make_weights, make_routing, T):
    experts = CpuExperts(*make_weights(E, H, I), format="bf16", threads=2, numa_nodes=2)
    x, ids, weights = make_routing(T, H, K, range(E))
    in_run = experts.forward(x, ids, weights)
    experts.tune(EngineTuning(combine_in_run=False))
    experts.trace(1)
    assert torch.equal(experts.forward(x, ids, weights), in_run)
    assert experts.take_trace()[0]["items"][:, CONVERT][-1] == 0  # no down item summed anything
