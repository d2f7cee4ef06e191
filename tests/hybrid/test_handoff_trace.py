"""CudaHandoff.trace / take_trace: the calls its polling thread runs, traced (moe_trace.h), without a GPU
(this test's thread plays the stream, as in test_handoff_flags.py). benchmarks/decode_cpu_trace.py reads
a running decode's CPU layers through them."""

import pytest

from test_handoff_flags import K, Layer, polling_handoff, stream_round

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
