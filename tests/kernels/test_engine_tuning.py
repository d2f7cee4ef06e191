"""EngineTuning (hybridmoe.experts.tuning): one object for the native engine's schedule knobs. An engine
starts with its defaults, tune() sets every knob at once and tuning reads them back; bad values are
refused before they reach the engine."""

from dataclasses import FrozenInstanceError, fields, replace

import pytest

from hybridmoe import CpuExperts
from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.cpu_experts import _native
from hybridmoe.experts.tuning import EngineTuning, from_native

E, H, I = 4, 64, 32


def test_an_engine_starts_with_the_defaults_and_the_native_ones_agree(make_weights):
    experts = CpuExperts(*make_weights(E, H, I), threads=1)
    assert experts.tuning == EngineTuning()
    assert from_native(_native().MoeTuning()) == EngineTuning()


def test_tune_sets_every_knob_and_tuning_reads_them_back(make_weights):
    experts = CpuExperts(*make_weights(E, H, I), threads=1)
    changed = EngineTuning(item_blocks=3, item_prefetch=0, kernel_prefetch_l1=2048, kernel_prefetch_l2=0,
                           early_start=False, padded_counters=False, tail_split=False, gate_up_tail=False,
                           balanced_items=False, combine_in_run=False, prefetch_touch=3)
    assert all(getattr(changed, f.name) != getattr(EngineTuning(), f.name) for f in fields(EngineTuning))
    experts.tune(changed)
    assert experts.tuning == changed
    experts.tune(replace(changed, item_blocks=0))
    assert experts.tuning == replace(changed, item_blocks=0)


@pytest.mark.parametrize("changes, match", [
    ({"item_blocks": -1}, "item_blocks must be an int >= 0"),
    ({"item_prefetch": 1.5}, "item_prefetch must be an int >= 0"),
    ({"prefetch_touch": 4}, "prefetch_touch must be 0"),
    ({"early_start": 1}, "early_start must be a bool"),
])
def test_bad_values_are_refused(changes, match):
    with pytest.raises(HybridMoEError, match=match):
        EngineTuning(**changes)


def test_tuning_is_a_value_and_tune_takes_only_it(make_weights):
    t = EngineTuning()
    with pytest.raises(FrozenInstanceError):
        t.item_blocks = 2
    experts = CpuExperts(*make_weights(E, H, I), threads=1)
    with pytest.raises(HybridMoEError, match="takes an EngineTuning"):
        experts.tune({"item_blocks": 2})
