"""set_schedule(block_steal=True): a worker that reaches a down item of an expert whose gate/up is not done
computes that expert's unclaimed gate/up blocks instead of waiting. Who computes a block never changes its
rows, so the output is bit-identical to block_steal off, and the trace still covers every block once.

Shapes: T tokens, K experts per token, E experts, H hidden, I expert intermediate size.
"""

import pytest
import torch

from hybridmoe import CpuExperts
from test_cpu_experts_trace import B0, B1, DOWN, EXPERT, STOLEN, check_call

E, H, I, K = 8, 160, 320, 3


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("T", [1, 4, 17])
@pytest.mark.parametrize("deferred", [0, 1])
def test_block_steal_changes_who_computes_not_the_result(make_weights, make_routing, isa, fmt, T, deferred):
    """Every item's own worker goes a block at a time (claimed from the front); small calls rarely leave a block
    to steal (the next test makes one that does)."""
    experts = CpuExperts(*make_weights(E, H, I), format=fmt, group_size=32, threads=3, isa=isa)
    x, ids, weights = make_routing(T, H, K, range(E))
    run = (lambda: experts.forward_deferred(x, ids, weights, deferred)) if deferred else (
        lambda: (experts.forward(x, ids, weights),))
    experts.set_schedule(item_blocks=5)
    expected = run()
    experts.set_schedule(block_steal=True)
    experts.trace(3)
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(run(), expected))
    for rec in experts.take_trace():
        check_call(rec, ids, threads=3, slices=1)


def test_a_worker_waiting_for_an_experts_h_computes_its_last_blocks(make_weights):
    """One one-token expert whose gate/up is one 10-block item: the other worker, at a down item of that expert,
    takes blocks from the item's back (a record of its own, marked stolen) while the item's worker goes from the
    front; together they cover each block once. Timing decides whether the second worker gets there in time (on a
    2-core dev box a sleeping worker wakes ~250 us into a call, the 8-block item takes ~300 us at H 8192), so this
    tries up to 200 calls; there 31 of 40 stole."""
    hidden = 8192
    experts = CpuExperts(*make_weights(2, hidden, I), format="bf16", threads=2)
    x, ids, weights = torch.randn(1, hidden), torch.tensor([[1]]), torch.tensor([[1.0]])
    experts.set_schedule(item_blocks=8, gate_up_tail=False)  # 8- and 2-block items of its 10 gate/up blocks
    expected = experts.forward(x, ids, weights)
    experts.set_schedule(block_steal=True)
    for _ in range(200):
        experts.trace(1)
        assert torch.equal(experts.forward(x, ids, weights), expected)
        rec = experts.take_trace()[0]
        items = rec["items"]
        stolen = items[items[:, STOLEN] == 1]
        if len(stolen):
            break
    else:
        pytest.fail("in 200 calls no worker computed a block of another's gate/up item")
    assert stolen[:, DOWN].eq(0).all() and stolen[:, EXPERT].eq(1).all() and (stolen[:, B1] > stolen[:, B0]).all()
    check_call(rec, ids, threads=2, slices=1)


def test_block_steal_is_off_by_default_and_set_schedule_switches_it(make_weights):
    experts = CpuExperts(*make_weights(E, H, I), threads=1)
    assert experts._engine.block_steal is False
    experts.set_schedule(block_steal=True)
    assert experts._engine.block_steal is True
