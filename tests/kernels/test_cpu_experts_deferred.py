"""CpuExperts.forward_deferred: one pass whose two outputs sum each token's first K - d slots and its last d, as
two forward() calls on those columns give them (on every kernel path here; one token per expert and several,
the weighted sums in the run and after it). When the own output is marked ready (mid-call) is the linked
handoff's business, tested in tests/hybrid/test_handoff_linked_deferral.py by its done words.

T tokens, K experts per token, E experts, H hidden, I expert intermediate size.
"""

import pytest
import torch

from hybridmoe import CpuExperts
from hybridmoe.errors import HybridMoEError

E, H, I, K = 16, 128, 96, 4


def routed(T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return x, ids, torch.rand(T, K, generator=g)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
# 17, 40: above the sums in the run (16 tokens); 128: 32 tokens per expert, AMX tiles for deferred experts too
@pytest.mark.parametrize("T", [1, 3, 17, 40, 128])
@pytest.mark.parametrize("deferred", [0, 1, 2, K])
def test_both_outputs_equal_forward_on_their_columns(make_weights, kernel_bound, rel_err, isa, fmt, T, deferred):
    experts = CpuExperts(*make_weights(E, H, I), format=fmt, group_size=32, threads=2, isa=isa)
    x, ids, w = routed(T, seed=T + 10 * deferred)
    out, out2 = experts.forward_deferred(x, ids, w, deferred)
    keep = K - deferred
    own = [t[:, :keep].contiguous() for t in (ids, w)]
    later = [t[:, keep:].contiguous() for t in (ids, w)]
    want = experts.forward(x, *own) if keep else torch.zeros_like(x)
    want2 = experts.forward(x, *later) if deferred else torch.zeros_like(x)
    # an expert shared by one token's own slots and another's deferred ones has more rows in one pass than in
    # either call, which may take it to another kernel (several-token kernels, AMX from 16 rows: avx512 and amx
    # at T=3 differ in the last bf16 bits, amx int8 at T=128 by AMX-INT8's activation rounding where one call has
    # an expert below 16 rows): bit for bit only at one token, else within twice the kernel's own bound of each
    # other
    for got, ref in ((out, want), (out2, want2)):
        if T == 1 or not ref.any():
            torch.testing.assert_close(got, ref, atol=0, rtol=0)
        else:
            assert rel_err(got, ref.float()) <= 2 * kernel_bound(fmt, isa)


def test_deferred_out_of_range_and_bad_out2_fail_with_a_message(make_weights):
    experts = CpuExperts(*make_weights(E, H, I), format="bf16", threads=1)
    x, ids, w = routed(2, seed=0)
    with pytest.raises(HybridMoEError, match="deferred must be between 0 and the 4 slots"):
        experts.forward_deferred(x, ids, w, K + 1)
    with pytest.raises(HybridMoEError, match="deferred must be between"):
        experts.forward_deferred(x, ids, w, -1)


def test_a_slot_of_weight_zero_may_repeat_an_expert(make_weights):
    """Padding (the hybrid split's compacted rows): a repeat in a slot of weight 0 adds nothing; a repeat of
    weight is still refused."""
    experts = CpuExperts(*make_weights(E, H, I), format="bf16", threads=1)
    x, ids, w = routed(2, seed=3)
    padded_ids, padded_w = ids.clone(), w.clone()
    padded_ids[:, 3], padded_w[:, 3] = ids[:, 0], 0.0
    want = experts.forward(x, ids[:, :3].contiguous(), w[:, :3].contiguous())
    torch.testing.assert_close(experts.forward(x, padded_ids, padded_w), want, atol=0, rtol=0)
    padded_w[0, 3] = 0.5
    with pytest.raises(HybridMoEError, match="lists expert .* twice"):
        experts.forward(x, padded_ids, padded_w)


def test_two_part_slots_feed_submit_deferred_as_the_torch_reference_computes_them(make_weights):
    """The synchronous hybrid path's one CPU call per layer with deferral: each side compacted (padding may repeat
    an expert of the token's other side), both sides' sums as the torch reference gives them."""
    from hybridmoe.experts.cpu_slots import two_part_slots
    from hybridmoe.experts.hybrid import TorchCpuLayer

    weights = make_weights(E, H, I)
    experts = CpuExperts(*weights, format="bf16", threads=2)
    ref = TorchCpuLayer(*(t.bfloat16().float() for t in weights))
    g = torch.Generator().manual_seed(7)
    T = 5
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    keep = torch.rand(T, K, generator=g) > 0.4  # the slots on the CPU (the others on the GPU)
    keep[0] = False  # a token with no CPU slot at all
    dense = two_part_slots(ids, w, keep, own=2)
    experts.submit_deferred(x, *dense)
    got = experts.wait()
    ref.submit_deferred(x.float(), *dense)
    want = ref.wait()
    for side, want_side in zip(got, want):
        assert side.shape == (T, H)
        torch.testing.assert_close(side.float(), want_side, atol=2e-2, rtol=2e-2)
    assert not got[0][0].any() and not got[1][0].any()  # the token with no CPU slot
