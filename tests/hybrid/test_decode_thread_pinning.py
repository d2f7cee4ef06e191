"""Where a decode step's thread runs: off the CPUs the CUDA handoff's pool pins its threads to, only for
the step (a pool made later still sees every CPU)."""

import os

import pytest

from hybridmoe.experts.cuda_handoff import driver_cpus, pinned


@pytest.mark.parametrize("threads, numa_nodes, allowed, expected", [
    (15, 1, range(16), {15}),         # the pool takes CPUs 0-14 (handoff_threads leaves one free)
    (4, 1, range(16), set(range(4, 16))),
    (3, 1, [8, 2, 5, 11], {11}),      # the first `threads` allowed CPUs in order, whatever the affinity
    (16, 1, range(16), set()),        # none left
    (1, 1, [0], set()),
    (7, 2, range(16), set()),         # per-node groups: not pinned
])
def test_driver_cpus_are_the_allowed_cpus_past_the_pools(threads, numa_nodes, allowed, expected):
    assert driver_cpus(threads, numa_nodes, allowed) == expected


def test_pinned_moves_the_thread_inside_the_block_and_back_after_it():
    before = os.sched_getaffinity(0)
    target = {max(before)}
    with pinned(target):
        assert os.sched_getaffinity(0) == target
    assert os.sched_getaffinity(0) == before
    with pytest.raises(RuntimeError), pinned(target):
        raise RuntimeError("a failed step")
    assert os.sched_getaffinity(0) == before


def test_nothing_to_pin_to_changes_nothing():
    before = os.sched_getaffinity(0)
    with pinned(set()):
        assert os.sched_getaffinity(0) == before
