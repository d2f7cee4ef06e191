"""CudaHandoff.trace / take_trace: the calls its polling thread runs, traced (moe_trace.h), without a GPU
(this test's thread plays the stream, as in test_handoff_flags.py). `benchmarks/decode.py cpu-trace` reads
a running decode's CPU layers through them."""

import hybridmoe._native as native
from dataclasses import replace

import pytest
import torch
from test_handoff_flags import K, Layer, polling_handoff, stream_round

from hybridmoe import CpuExperts
from hybridmoe.experts.tuning import EngineTuning, from_native, to_native

T = 3


def test_a_traced_layer_records_the_calls_the_poller_runs_and_no_others():
    layers = [Layer(0), Layer(1)]
    handoff, flags = polling_handoff(layers)
    handoff.trace(1, 2)  # layer 1's next two calls
    routed = []
    for rnd in range(3):
        for i, layer in enumerate(layers):
            layer.fill(T, seed=10 * rnd + i)
        routed.append(set(layers[1].ids[:T].flatten().tolist()))
        stream_round(handoff, flags, [0, 1], T)
    assert handoff.take_trace(0) == []
    records = handoff.take_trace(1)
    assert len(records) == 2
    for rec, experts in zip(records, routed):
        assert (rec["T"], rec["K"], rec["A"]) == (T, K, len(experts))
        # the poller's run() stamps call_ns too: a call's times are in order, on time.monotonic_ns's clock
        assert 0 < rec["call_ns"] <= rec["entry_ns"] <= rec["items_ns"] <= rec["gemm_end_ns"] <= rec["end_ns"]
        assert rec["items"].shape[1] == 11 and set(rec["items"][:, 2].tolist()) == experts
        assert rec["join_ns"].shape == rec["slept"].shape == (layers[1].experts.threads,)
    assert handoff.take_trace(1) == []  # taken, and the third call was not traced


def test_trace_refuses_a_layer_out_of_range_and_a_negative_count():
    handoff, _ = polling_handoff([Layer(0)])
    with pytest.raises(ValueError, match="out of range"):
        handoff.trace(1, 1)
    with pytest.raises(ValueError, match=">= 0"):
        handoff.trace(0, -1)
    with pytest.raises(ValueError, match="out of range"):
        handoff.take_trace(-1)


def test_tuning_reaches_every_layer_of_the_handoff_and_leaves_the_output_alone():
    """The handoff's tuning sets each layer's engine: with gate_up_tail off (on by default) its traced calls end
    their gate/up items in items of several blocks (experts of 256 intermediate rows: 8 blocks), on in 1-block ones;
    item_blocks 1 cuts every item to one block; the output stays the same."""
    E, H, I = 8, 64, 256
    g = torch.Generator().manual_seed(0)
    handoff = native.CudaHandoff(1, K)
    staged = []
    for _ in range(2):
        cpu = CpuExperts(torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g),
                         torch.randn(E, H, I, generator=g), format="bf16", threads=2)
        st = cpu.packed_state()
        bufs = (torch.randn(1, H, generator=g).bfloat16(), torch.tensor([[1, 6]]), torch.tensor([[0.7, 0.3]]),
                torch.zeros(1, H, dtype=torch.bfloat16))
        handoff.add_layer(E, H, I, st["format"], st["group_size"], st["zero_points"], 2, cpu.isa, st["numa_nodes"],
                          st["buffers"], *bufs)
        staged.append((cpu, bufs))
    flags = torch.zeros(handoff.flag_words, dtype=torch.int32)
    handoff.start_polling(flags, False)

    def traced_round():
        for i in (0, 1):
            handoff.trace(i, 1)
        stream_round(handoff, flags, [0, 1], 1)
        return [handoff.take_trace(i)[0]["items"] for i in (0, 1)]

    def tune(**changes):
        handoff.tuning = to_native(replace(from_native(handoff.tuning), **changes), native.MoeTuning)

    last_gate_up = lambda items: (lambda up: (up[-1, 5] - up[-1, 4]).item())(items[items[:, 1] == 0])  # b1 - b0
    assert from_native(handoff.tuning) == EngineTuning()
    tune(gate_up_tail=False)
    assert handoff.tuning.gate_up_tail is False
    assert all(last_gate_up(items) > 1 for items in traced_round())
    tune(gate_up_tail=True)
    assert all(last_gate_up(items) == 1 for items in traced_round())
    tune(gate_up_tail=False, item_blocks=1)
    assert all(((items[:, 5] - items[:, 4]) == 1).all() for items in traced_round())
    for cpu, (x, ids, w, out) in staged:
        assert torch.equal(out, cpu.forward(x, ids, w))
    assert handoff.take_error() is None


def test_tuning_refuses_a_negative_size_and_needs_a_layer():
    handoff, _ = polling_handoff([Layer(0)])
    t = native.MoeTuning()
    t.item_blocks = -1
    with pytest.raises(ValueError, match="item_blocks must be >= 0"):
        handoff.tuning = t
    with pytest.raises(ValueError, match="no layer yet"):
        native.CudaHandoff(1, K).tuning
