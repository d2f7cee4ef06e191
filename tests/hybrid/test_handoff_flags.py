"""The stream-memory-op handoff's flag protocol without a GPU: this test's thread plays the
stream (after staging a layer's rows it clears the done word and writes go = T; later it waits
for done == 1), the native poller thread plays the CPU side. Several rounds stand for several graph replays: the
values written are the same each time, as in a captured graph.

T tokens, K experts per token, E experts, H hidden, I expert intermediate size.
"""

import time

import hybridmoe._native as native
import pytest
import torch

from hybridmoe import CpuExperts

E, H, I, K, TMAX = 8, 64, 32, 2, 4


def experts(seed: int) -> CpuExperts:
    g = torch.Generator().manual_seed(seed)
    return CpuExperts(torch.randn(E, I, H, generator=g) / H**0.5, torch.randn(E, I, H, generator=g) / H**0.5,
                      torch.randn(E, H, I, generator=g) / I**0.5, format="bf16", threads=2)


class Layer:
    """One layer's CpuExperts and staging buffers x, out [TMAX, H]; ids, weights [TMAX, K]."""

    def __init__(self, seed: int):
        self.experts = experts(seed)
        self.x = torch.zeros(TMAX, H, dtype=torch.bfloat16)
        self.ids = torch.zeros(TMAX, K, dtype=torch.int64)
        self.w = torch.zeros(TMAX, K)
        self.out = torch.zeros(TMAX, H, dtype=torch.bfloat16)

    def fill(self, T: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x[:T] = torch.randn(T, H, generator=g).to(torch.bfloat16)
        self.ids[:T] = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
        self.w[:T] = torch.rand(T, K, generator=g)
        self.out.fill_(7.0)

    def expected(self, T: int) -> torch.Tensor:
        return self.experts.forward(self.x[:T].clone(), self.ids[:T].clone(), self.w[:T].clone())


def polling_handoff(layers: list[Layer]):
    """A native handoff in polling mode over plain (not device-mapped) flag words."""
    handoff = native.CudaHandoff(TMAX, K)
    for layer in layers:
        st = layer.experts.packed_state()
        handoff.add_layer(E, H, I, st["format"], st["group_size"], st["zero_points"], layer.experts.threads,
                          layer.experts.isa, st["numa_nodes"], st["buffers"], layer.x, layer.ids, layer.w, layer.out)
    flags = torch.zeros(handoff.flag_words, dtype=torch.int32)
    handoff.start_polling(flags, False)
    return handoff, flags


def wait_for(flags: torch.Tensor, word: int, value: int, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while flags[word].item() != value:
        assert time.monotonic() < end, f"flag word {word} never became {value}"


def submit(handoff, flags, i: int, T: int) -> None:
    flags[handoff.done_word(i)] = 0
    flags[handoff.go_word(i)] = T


def stream_round(handoff, flags, indices: list[int], T: int) -> None:
    """What the stream does for these layers: every submit, then every wait."""
    for i in indices:
        submit(handoff, flags, i, T)
    for i in indices:
        wait_for(flags, handoff.done_word(i), 1)
        assert flags[handoff.go_word(i)].item() == 0  # the poller cleared go before it set done


def test_poller_answers_the_stream_round_after_round():
    layers = [Layer(0), Layer(1)]
    handoff, flags = polling_handoff(layers)
    assert handoff.mode == "stream_mem_ops"
    for rnd, T in enumerate([1, 3, 3, 4, 1]):
        for i, layer in enumerate(layers):
            layer.fill(T, seed=10 * rnd + i)
        stream_round(handoff, flags, [0, 1], T)  # both layers pending at once
        for layer in layers:
            assert torch.equal(layer.out[:T], layer.expected(T))
            assert (layer.out[T:] == 7.0).all()  # only the T rows asked for were written
    assert handoff.take_error() is None
    assert not any(flags[handoff.go_word(i)].item() for i in range(2))
    stats = handoff.take_stats()
    assert stats["layers"] == 10 and stats["cpu_ns"] > 0
    assert set(handoff.take_stats().values()) == {0}


def test_a_go_never_waited_for_leaves_no_stale_done():
    layer = Layer(0)
    handoff, flags = polling_handoff([layer])
    layer.fill(2, seed=0)
    submit(handoff, flags, 0, 2)  # an abandoned step: its done word stays set
    wait_for(flags, handoff.done_word(0), 1)
    layer.fill(2, seed=1)
    stream_round(handoff, flags, [0], 2)
    assert torch.equal(layer.out[:2], layer.expected(2))


def test_run_in_polling_mode_equals_forward():
    layers = [Layer(2), Layer(3)]
    handoff, _ = polling_handoff(layers)
    for layer in layers:
        layer.fill(2, seed=5)
    handoff.run([0, 1], 2)
    for layer in layers:
        assert torch.equal(layer.out[:2], layer.expected(2))


def test_out_of_range_id_zeroes_the_layer_and_done_is_still_set():
    layer = Layer(0)
    handoff, flags = polling_handoff([layer])
    layer.fill(2, seed=0)
    layer.ids[1, 0] = -1
    stream_round(handoff, flags, [0], 2)
    assert not layer.out[:2].any()
    assert "topk_ids[1, 0] = -1 is out of range for 8 experts" in handoff.take_error()
    layer.fill(2, seed=0)
    stream_round(handoff, flags, [0], 2)
    assert torch.equal(layer.out[:2], layer.expected(2)) and handoff.take_error() is None


def test_a_deleted_handoff_is_no_longer_polled():
    layer = Layer(0)
    handoff, flags = polling_handoff([layer])
    go = handoff.go_word(0)
    del handoff
    layer.fill(1, seed=0)
    flags[go] = 1
    time.sleep(0.05)
    assert flags[go].item() == 1 and (layer.out == 7.0).all()


def test_idle_poller_naps_instead_of_spinning():
    handoff, _ = polling_handoff([Layer(0)])
    time.sleep(0.25)  # past the spin window (2 ms) and into the long naps (after 100 ms)
    assert native.flag_poller_napping()
    cpu0, wall0 = time.process_time(), time.monotonic()
    time.sleep(0.5)
    # A spinning poller would use ~0.5 s of CPU here; 1 ms naps use a few ms.
    assert time.process_time() - cpu0 < 0.15 * (time.monotonic() - wall0)
    del handoff


def test_flag_word_errors():
    layer = Layer(0)
    handoff = native.CudaHandoff(TMAX, K)
    with pytest.raises(ValueError, match="add the layers before start_polling"):
        handoff.start_polling(torch.zeros(64, dtype=torch.int32), False)
    st = layer.experts.packed_state()
    args = (E, H, I, st["format"], st["group_size"], st["zero_points"], 2, layer.experts.isa, st["numa_nodes"],
            st["buffers"], layer.x, layer.ids, layer.w, layer.out)
    handoff.add_layer(*args)
    words = handoff.flag_words
    assert words == 2 * 16 and handoff.go_word(0) == 0 and handoff.done_word(0) == 16  # one 64-byte line each
    with pytest.raises(ValueError, match=f"{words} needed for 1 layers, got {words - 1}"):
        handoff.start_polling(torch.zeros(words - 1, dtype=torch.int32), False)
    with pytest.raises(ValueError, match="1-d array of 32-bit integers"):
        handoff.start_polling(torch.zeros(words, dtype=torch.float32), False)
    with pytest.raises(ValueError, match="64-byte boundary"):
        handoff.start_polling(torch.zeros(words + 16, dtype=torch.int32)[1:], False)
    with pytest.raises(ValueError, match="layer index 1 out of range"):
        handoff.go_word(1)
    handoff.start_polling(torch.zeros(words, dtype=torch.int32), False)
    with pytest.raises(ValueError, match="start_polling was called twice"):
        handoff.start_polling(torch.zeros(words, dtype=torch.int32), False)
    with pytest.raises(ValueError, match="layers must be added before start_polling"):
        handoff.add_layer(*args)
    with pytest.raises(ValueError, match="not device-mapped"):
        handoff.enqueue_forward(0, 0, 1)


def test_stats_split_each_step_into_cpu_work_and_the_gaps_between_layers():
    """The stand-in stream runs 3 steps of 3 layers, one after another (as a decode step does), with
    a known gap between one layer's done and the next layer's go."""
    layers = [Layer(i) for i in range(3)]
    handoff, flags = polling_handoff(layers)
    gap_s, steps = 0.004, 3
    handoff.take_stats()
    for step in range(steps):
        for i, layer in enumerate(layers):
            layer.fill(1, seed=10 * step + i)
            if i:
                time.sleep(gap_s)
            stream_round(handoff, flags, [i], 1)
            assert torch.equal(layer.out[:1], layer.expected(1))
    stats = handoff.take_stats()
    assert (stats["layers"], stats["steps"], stats["gaps"]) == (9, 3, 6)
    assert stats["first_cpu_ns"] > 0 and stats["cpu_ns"] > stats["first_cpu_ns"]
    assert stats["cpu_ns"] / 9 <= stats["cpu_max_ns"] <= stats["cpu_ns"]
    assert stats["late_max_ns"] * 9 >= stats["late_ns"]
    assert gap_s * 1e9 <= stats["between_ns"] / 6 < 20 * gap_s * 1e9  # each gap holds the sleep


def test_a_go_that_finds_the_poller_napping_is_late_by_about_a_nap():
    layer = Layer(0)
    handoff, flags = polling_handoff([layer])
    time.sleep(0.25)  # the poller naps 1 ms at a time now
    handoff.take_stats()
    layer.fill(1, seed=0)
    stream_round(handoff, flags, [0], 1)
    stats = handoff.take_stats()
    assert (stats["steps"], stats["gaps"]) == (1, 0)
    assert stats["first_late_ns"] == stats["late_ns"] >= 500_000
    assert stats["late_max_ns"] == stats["late_ns"] and stats["slow_lates"] == 1


def test_trim_padding_leaves_out_one_tokens_trailing_zero_weight_slots():
    """A token whose other experts are on the GPU comes padded: its last slots repeat one of its own
    experts with weight 0. Trimmed, the layer computes the kept slots only; none kept gives zeros."""
    layer = Layer(0)
    handoff, flags = polling_handoff([layer])
    handoff.trim_padding = True
    layer.fill(1, seed=3)
    layer.ids[0, 1], layer.w[0, 1] = layer.ids[0, 0], 0.0  # the padding
    stream_round(handoff, flags, [0], 1)
    kept = layer.experts.forward(layer.x[:1].clone(), layer.ids[:1, :1].clone(), layer.w[:1, :1].clone())
    assert torch.equal(layer.out[:1], kept)
    layer.w[0, 0] = 0.0  # nothing kept
    stream_round(handoff, flags, [0], 1)
    assert not layer.out[:1].any() and handoff.take_error() is None
    layer.fill(2, seed=4)  # two tokens: the rows keep their width (no trimming)
    stream_round(handoff, flags, [0], 2)
    assert torch.equal(layer.out[:2], layer.expected(2))
