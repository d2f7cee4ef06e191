import pytest

from hybridmoe.bench.anatomy import step_anatomy


def stats(**over):
    """take_stats() of one handoff: 10 steps of 4 layers, 200 us of CPU work each (250 the first)."""
    base = dict(layers=40, cpu_us=40 * 200 + 10 * 50, late_us=40 * 0.5, steps=10, first_cpu_us=10 * 250,
                first_late_us=10 * 2.0, gaps=30, between_us=30 * 100)
    return {**base, **over}


def test_a_step_is_its_layers_cpu_work_the_gaps_between_them_and_the_rest():
    a = step_anatomy([stats()], step_s=2e-3)
    assert (a.steps, a.layers_per_step) == (10, 4)
    assert a.cpu_us == pytest.approx(212.5) and a.first_cpu_us == pytest.approx(250)
    assert a.gap_us == pytest.approx(100)
    assert a.late_us == pytest.approx(0.5) and a.first_late_us == pytest.approx(2.0)
    assert a.rest_us == pytest.approx(2000 - 4 * 212.5 - 3 * 100)


def test_no_stream_mem_ops_handoff_or_no_step_gives_none():
    assert step_anatomy([], 1e-3) is None
    assert step_anatomy([None], 1e-3) is None  # host_function path
    assert step_anatomy([stats(layers=0, steps=0, gaps=0)], 1e-3) is None


def test_a_second_handoff_adds_its_layers_to_the_same_steps():
    deferred = stats(layers=10, cpu_us=10 * 50, first_cpu_us=10 * 50, gaps=0, between_us=0)
    a = step_anatomy([stats(), deferred], step_s=2e-3)
    assert a.steps == 10 and a.layers_per_step == 5
    assert a.rest_us is None  # the deferred layers' CPU work runs inside the other handoff's gaps
