"""ThreadPool::help (the decode thread working in the CUDA handoff's pool while it waits for its step,
HybridExperts.wait_step): a thread that is not the pool's joins its runs as one more worker. Every item
of every run still runs exactly once, and the helper leaves once it is told to. Whether it takes items
of a free-running run is scheduling luck (the pool's threads may claim them all first); what help()
guarantees is that it joins every run still open when it looks: with the pool's threads held inside
their items until the helper has one, each run stays open for it and it takes at least one item of each."""

import pytest

from hybridmoe.experts.cpu_experts import _native

RUNS, ITEMS = 300, 48


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_item_of_every_run_runs_once_and_the_helper_returns(threads):
    *counts, helped = _native()._pool_help_check(threads, RUNS, ITEMS, False)
    assert counts == [RUNS] * ITEMS
    assert 0 <= helped <= RUNS * ITEMS
    if threads == 1:  # a pool of one thread has no workers to join: its helper only waits
        assert helped == 0


@pytest.mark.parametrize("threads", [2, 3])
def test_a_helper_takes_an_item_of_every_run_that_stays_open_for_it(threads):
    # the pool's threads hold at most `threads` items while they wait: ITEMS > threads leaves the helper some
    runs = 100
    *counts, helped = _native()._pool_help_check(threads, runs, ITEMS, True)
    assert counts == [runs] * ITEMS
    assert helped >= runs


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match=">= 1"):
        _native()._pool_help_check(0, 1, 1, False)
