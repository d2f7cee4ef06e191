"""Expert deferral in one CPU call per layer through two linked native handoffs (link_deferred), without a GPU:
this test's thread plays the stream (it stages the own part's rows in one handoff and the deferred part's ids
and weights in the other, clears both done words and writes only the own go word), the native poller runs both
parts as one call. Each output equals forward() on its columns, padding slots of weight 0 trimmed at one token.

T tokens, K own slots, KD deferred slots per token, E experts, H hidden, I expert intermediate size.
"""

import hybridmoe._native as native
import pytest
import torch
from test_handoff_flags import wait_for

from hybridmoe import CpuExperts

E, H, I, K, KD, TMAX = 8, 64, 32, 3, 2, 4


def experts(seed: int) -> CpuExperts:
    g = torch.Generator().manual_seed(seed)
    return CpuExperts(torch.randn(E, I, H, generator=g) / H**0.5, torch.randn(E, I, H, generator=g) / H**0.5,
                      torch.randn(E, H, I, generator=g) / I**0.5, format="bf16", threads=2)


class Part:
    """One handoff's staging buffers for a layer: x, out [TMAX, H]; ids, weights [TMAX, width]."""

    def __init__(self, width: int, ids_dtype=torch.int64):
        self.x = torch.zeros(TMAX, H, dtype=torch.bfloat16)
        self.ids = torch.zeros(TMAX, width, dtype=ids_dtype)
        self.w = torch.zeros(TMAX, width)
        self.out = torch.full((TMAX, H), 7.0, dtype=torch.bfloat16)


def handoff_of(layers: list[tuple[CpuExperts, Part]], width: int):
    h = native.CudaHandoff(TMAX, width)
    for ex, part in layers:
        st = ex.packed_state()
        h.add_layer(E, H, I, st["format"], st["group_size"], st["zero_points"], ex.threads, ex.isa, st["numa_nodes"],
                    st["buffers"], part.x, part.ids, part.w, part.out)
    flags = torch.zeros(h.flag_words, dtype=torch.int32)
    h.start_polling(flags, False)
    return h, flags


def linked(seeds=(0, 1), deferred_ids=torch.int64):
    """(own handoff, its flags, deferred handoff, its flags, [(experts, own part, deferred part)]), all linked."""
    layers = [(experts(s), Part(K), Part(KD, deferred_ids)) for s in seeds]
    own, own_flags = handoff_of([(ex, o) for ex, o, _ in layers], K)
    later, later_flags = handoff_of([(ex, d) for ex, _, d in layers], KD)
    for i in range(len(layers)):
        own.link_deferred(i, later, i)
    return own, own_flags, later, later_flags, layers


def fill(layer, T: int, seed: int, pad_own: int = 0, pad_later: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage T tokens' rows (the last pad_* slots of each part padding: weight 0, repeating the part's first
    expert); returns what forward() gives for the own part and for the deferred part."""
    ex, o, d = layer
    g = torch.Generator().manual_seed(seed)
    o.x[:T] = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K + KD] for _ in range(T)])
    w = torch.rand(T, K + KD, generator=g)
    for lo, hi, pad in ((0, K, pad_own), (K, K + KD, pad_later)):
        if pad:
            ids[:, hi - pad:hi] = ids[:, lo:lo + 1]
            w[:, hi - pad:hi] = 0.0
    o.ids[:T], o.w[:T] = ids[:, :K], w[:, :K]
    d.ids[:T], d.w[:T] = ids[:, K:], w[:, K:]
    o.out.fill_(7.0)
    d.out.fill_(7.0)
    x = o.x[:T].clone()

    def part(lo, hi):  # forward() wants distinct ids per token: leave the padding out (it adds 0)
        keep = hi - lo - (pad_own if lo == 0 else pad_later)
        if keep == 0:
            return torch.zeros_like(x)
        return ex.forward(x, ids[:, lo:lo + keep].contiguous(), w[:, lo:lo + keep].contiguous())
    return part(0, K), part(K, K + KD)


def stream(own, own_flags, later, later_flags, indices: list[int], T: int) -> None:
    """Per layer: clear both done words, write the own go (merged); then wait for both done words."""
    for i in indices:
        own_flags[own.done_word(i)] = 0
        later_flags[later.done_word(i)] = 0
        own_flags[own.go_word(i)] = T | native.CudaHandoff.merged_go
    for i in indices:
        wait_for(own_flags, own.done_word(i), 1)
        wait_for(later_flags, later.done_word(i), 1)


@pytest.mark.parametrize("T,pad_own,pad_later", [(1, 0, 0), (1, 1, 1), (1, K, 0), (1, 0, KD), (3, 1, 0), (4, 0, 0)])
def test_linked_layers_give_both_parts_from_one_go(T, pad_own, pad_later):
    own, own_flags, later, later_flags, layers = linked()
    own.trim_padding = later.trim_padding = True
    for rnd in range(3):  # replays: the same words and values each time
        want = [fill(layer, T, seed=10 * rnd + i, pad_own=pad_own, pad_later=pad_later)
                for i, layer in enumerate(layers)]
        stream(own, own_flags, later, later_flags, [0, 1], T)
        for (ex, o, d), (want_own, want_later) in zip(layers, want):
            torch.testing.assert_close(o.out[:T], want_own, atol=0, rtol=0)
            torch.testing.assert_close(d.out[:T], want_later, atol=0, rtol=0)
            assert (o.out[T:] == 7.0).all() and (d.out[T:] == 7.0).all()
    assert own.take_error() is None and later.take_error() is None
    assert not any(later_flags[later.go_word(i)].item() for i in range(2))  # the deferred go is never used
    stats, later_stats = own.take_stats(), later.take_stats()
    assert stats["layers"] == later_stats["layers"] == 6


def test_a_plain_go_runs_the_own_part_alone_and_the_deferred_part_on_its_own_go():
    """The caller-routed path of HybridExperts: each part staged and started by its own go, as unlinked."""
    own, own_flags, later, later_flags, layers = linked(seeds=(2,))
    want_own, want_later = fill(layers[0], 2, seed=1)
    ex, o, d = layers[0]
    own_flags[own.done_word(0)] = 0
    own_flags[own.go_word(0)] = 2
    wait_for(own_flags, own.done_word(0), 1)
    torch.testing.assert_close(o.out[:2], want_own, atol=0, rtol=0)
    assert (d.out == 7.0).all()
    d.x.copy_(o.x)  # unlinked, the deferred part reads its own staged rows
    later_flags[later.done_word(0)] = 0
    later_flags[later.go_word(0)] = 2
    wait_for(later_flags, later.done_word(0), 1)
    torch.testing.assert_close(d.out[:2], want_later, atol=0, rtol=0)


def test_a_merged_go_without_a_link_is_an_error_and_still_answered():
    ex = experts(0)
    p = Part(K)
    h, flags = handoff_of([(ex, p)], K)
    flags[h.go_word(0)] = 1 | native.CudaHandoff.merged_go
    wait_for(flags, h.done_word(0), 1)
    assert "a merged go, but no deferred part is linked" in h.take_error()
    assert not p.out[:1].any() and (p.out[1:] == 7.0).all()  # the layer's output zeroed, as for other failures


def test_run_on_host_serves_linked_layers_in_one_call():
    own, _, later, _, layers = linked(seeds=(3,), deferred_ids=torch.int32)
    want_own, want_later = fill(layers[0], 2, seed=5)
    own.run([0], 2)
    ex, o, d = layers[0]
    torch.testing.assert_close(o.out[:2], want_own, atol=0, rtol=0)
    torch.testing.assert_close(d.out[:2], want_later, atol=0, rtol=0)


def test_an_out_of_range_deferred_id_zeroes_both_parts_and_sets_both_done_words():
    own, own_flags, later, later_flags, layers = linked(seeds=(0,))
    fill(layers[0], 2, seed=0)
    layers[0][2].ids[1, 1] = E
    stream(own, own_flags, later, later_flags, [0], 2)
    assert not layers[0][1].out[:2].any() and not layers[0][2].out[:2].any()
    assert "topk_ids[1, 1] = 8 is out of range for 8 experts" in later.take_error()


def test_link_errors():
    ex = experts(0)
    own, _ = handoff_of([(ex, Part(K))], K)
    later, _ = handoff_of([(experts(1), Part(KD))], KD)
    with pytest.raises(ValueError, match="does not compute with layer 0's packed experts"):
        own.link_deferred(0, later, 0)
    with pytest.raises(ValueError, match="a handoff of its own"):
        own.link_deferred(0, own, 0)
    with pytest.raises(ValueError, match="layer index 1 out of range"):
        own.link_deferred(0, later, 1)
    idle = native.CudaHandoff(TMAX, KD)
    st = ex.packed_state()
    p = Part(KD)
    idle.add_layer(E, H, I, st["format"], st["group_size"], st["zero_points"], ex.threads, ex.isa, st["numa_nodes"],
                   st["buffers"], p.x, p.ids, p.w, p.out)
    with pytest.raises(ValueError, match="needs both handoffs polling"):
        own.link_deferred(0, idle, 0)
