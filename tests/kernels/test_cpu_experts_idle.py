"""An idle pool sleeps: no busy-waiting workers between requests, even after a decode-like burst."""

import time

import torch

from hybridmoe import CpuExperts

E, H, I = 8, 96, 64
IDLE_S = 0.2


def decode_burst(layers, x, ids, weights, gap_s):
    """Calls the layers in turn with `gap_s` between calls (what grows the workers' spin window)."""
    for _ in range(20):
        for layer in layers:
            layer.submit(x, ids, weights)
            layer.wait()
            layer.forward(x, ids, weights)
            deadline = time.perf_counter() + gap_s
            while time.perf_counter() < deadline:
                pass


def test_pool_sleeps_after_a_burst_of_calls(make_weights, make_routing):
    layers = [CpuExperts(*make_weights(E, H, I, seed=s), threads=2) for s in range(2)]
    x, ids, weights = make_routing(1, H, 2, range(E))
    decode_burst(layers, x, ids, weights, gap_s=300e-6)
    # Process CPU time (every thread) while this thread sleeps: a spinning worker alone would
    # add ~IDLE_S; the spin window (at most 2 ms per thread) and wake-ups add a few ms.
    cpu0 = time.process_time()
    time.sleep(IDLE_S)
    assert time.process_time() - cpu0 < 0.25 * IDLE_S


def test_prewake_before_a_call_changes_nothing_but_timing(make_weights, make_routing):
    layer = CpuExperts(*make_weights(E, H, I), threads=2)
    x, ids, weights = make_routing(3, H, 2, range(E))
    expected = layer.forward(x, ids, weights)
    time.sleep(0.01)  # the workers are asleep now: prewake wakes them, a second one is a no-op
    layer.prewake()
    layer.prewake()
    assert torch.equal(layer.forward(x, ids, weights), expected)
    layer.prewake()
    layer.submit(x, ids, weights)
    assert torch.equal(layer.wait(), expected)
