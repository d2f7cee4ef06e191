"""Uneven routing: idle experts, one expert taking every token, id dtypes, async use."""

import pytest
import torch

from hybridmoe import CpuExperts
from hybridmoe.experts.torch_ref import ref_moe

E, H, I = 8, 96, 64


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_experts_without_tokens_and_one_expert_with_all(make_weights, make_routing, kernel_bound, rel_err,
                                                        dequantized_layer, fmt, isa):
    experts = CpuExperts(*make_weights(E, H, I), format=fmt, group_size=32, threads=2, isa=isa)
    deq = dequantized_layer(experts)
    # Experts 0, 5, 6, 7 get nothing; then all 40 tokens on expert 3 alone.
    for T, K, pool in [(23, 2, [1, 2, 3, 4]), (40, 1, [3])]:
        x, ids, weights = make_routing(T, H, K, pool)
        out = experts.forward(x, ids, weights)
        assert rel_err(out, ref_moe(x, *deq, ids, weights)) < kernel_bound(fmt, isa)


def test_int32_and_int64_ids_agree(make_weights, make_routing):
    experts = CpuExperts(*make_weights(E, H, I), threads=2)
    x, ids, weights = make_routing(7, H, 3, range(E))
    assert torch.equal(experts.forward(x, ids.int(), weights), experts.forward(x, ids.long(), weights))


def test_repeated_calls_are_bitwise_equal(make_weights, make_routing):
    experts = CpuExperts(*make_weights(E, H, I), format="int8", threads=2)
    x, ids, weights = make_routing(33, H, 4, range(E))
    first = experts.forward(x, ids, weights)
    assert all(torch.equal(first, experts.forward(x, ids, weights)) for _ in range(3))


def test_submit_then_wait_equals_forward_across_layers(make_weights, make_routing):
    # Two layers share one pool: both submitted, then both awaited, in order.
    layers = [CpuExperts(*make_weights(E, H, I, seed=s), threads=2) for s in range(2)]
    x, ids, weights = make_routing(5, H, 2, range(E))
    expected = [layer.forward(x, ids, weights) for layer in layers]
    for layer in layers:
        layer.submit(x, ids, weights)
    assert all(torch.equal(layer.wait(), e) for layer, e in zip(layers, expected))


def test_more_threads_than_cores_gives_the_same_result(make_weights, make_routing):
    w = make_weights(E, H, I)
    x, ids, weights = make_routing(50, H, 2, range(E))
    one = CpuExperts(*w, format="int4", group_size=32, threads=1).forward(x, ids, weights)
    many = CpuExperts(*w, format="int4", group_size=32, threads=5).forward(x, ids, weights)
    assert torch.equal(one, many)


def test_zero_tokens_gives_empty_output(make_weights):
    experts = CpuExperts(*make_weights(E, H, I), threads=2)
    out = experts.forward(torch.empty(0, H), torch.empty(0, 2, dtype=torch.long), torch.empty(0, 2))
    assert out.shape == (0, H)
