"""ThreadPool::help (the decode thread working in the CUDA handoff's pool while it waits for its step,
HybridExperts.wait_step): a thread that is not the pool's joins its runs as one more worker. Every item
of every run still runs exactly once, the helper takes some of them, and it leaves once it is told to."""

import pytest

from hybridmoe.experts.cpu_experts import _native


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_helper_joins_the_runs_and_every_item_runs_once(threads):
    runs, items = 300, 48
    *counts, helped = _native()._pool_help_check(threads, runs, items)
    assert counts == [runs] * items
    if threads > 1:  # a pool of one thread has no workers to join: its helper only waits
        assert 0 < helped < runs * items
    else:
        assert helped == 0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match=">= 1"):
        _native()._pool_help_check(0, 1, 1)
