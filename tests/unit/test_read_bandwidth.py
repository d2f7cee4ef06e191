import math

import hybridmoe._native as native
import pytest

from hybridmoe.system import bandwidth

SMALL = 32 << 20  # bytes: enough blocks for every worker, fast on a 2-core CI machine


def test_native_probe_reads_at_a_plausible_rate():
    bps = native.read_bandwidth(SMALL, 1, passes=3, rounds=1)
    # one core streams somewhere between a slow VM (~1 GB/s) and a cache-resident buffer (~1 TB/s)
    assert math.isfinite(bps) and 1e8 < bps < 1e13


def test_native_probe_uses_the_widest_loads_the_cpu_has():
    feats = native.cpu_features()
    expected = "avx512" if feats["avx512f"] else "avx2" if feats["avx2"] else "generic"
    assert native.read_bandwidth_isa() == expected


@pytest.mark.parametrize("kwargs", [dict(nbytes=0, threads=1), dict(nbytes=SMALL, threads=0),
                                    dict(nbytes=SMALL, threads=1, passes=0), dict(nbytes=SMALL, threads=1, rounds=0)])
def test_native_probe_rejects_empty_work(kwargs):
    with pytest.raises(ValueError, match="at least 1"):
        native.read_bandwidth(**kwargs)


def test_host_read_bandwidth_is_the_native_probe_when_built(monkeypatch):
    calls = []
    monkeypatch.setattr(native, "read_bandwidth", lambda n, t, passes: calls.append((n, t, passes)) or 5e10)
    assert bandwidth.host_read_bandwidth(SMALL, 2, repeats=4) == 5e10
    assert calls == [(SMALL, 2, 4)]
    assert bandwidth.host_read_method() == f"native {native.read_bandwidth_isa()} loads"


def test_host_read_bandwidth_falls_back_to_torch_without_the_extension(monkeypatch):
    monkeypatch.setattr(bandwidth, "native_engine_built", lambda: False)
    monkeypatch.setattr(native, "read_bandwidth", lambda *a, **k: pytest.fail("native probe called"))
    bps = bandwidth.host_read_bandwidth(SMALL, 1, repeats=2)
    assert math.isfinite(bps) and bps > 1e8
    assert bandwidth.host_read_method() == "float32 sum"


@pytest.mark.parametrize("plain, prefetching", [(5e10, 6e10), (7e10, 6e10)])
def test_floor_bandwidth_is_the_faster_of_plain_and_prefetching_loads(monkeypatch, plain, prefetching):
    calls = []
    monkeypatch.setattr(native, "read_bandwidth", lambda n, t, passes=5, prefetch=False:
                        calls.append(prefetch) or (prefetching if prefetch else plain))
    assert bandwidth.floor_bandwidth(SMALL, 2) == max(plain, prefetching)
    assert sorted(calls) == [False, True]
    assert bandwidth.floor_bandwidth_method().endswith("the higher of plain and prefetching")


def test_floor_bandwidth_without_the_extension_is_the_torch_probe(monkeypatch):
    monkeypatch.setattr(bandwidth, "native_engine_built", lambda: False)
    monkeypatch.setattr(native, "read_bandwidth", lambda *a, **k: pytest.fail("native probe called"))
    assert math.isfinite(bandwidth.floor_bandwidth(SMALL, 1)) and bandwidth.floor_bandwidth_method() == "float32 sum"


def test_per_worker_probe_gives_each_reading_worker_a_plausible_rate():
    rates = native.read_bandwidth_by_worker(SMALL, 2, passes=2)
    # The caller always reads; the pinned worker too unless it woke after every block was taken
    # (a loaded CI machine): 0, not a made-up rate.
    assert len(rates) == 2 and 1e8 < rates[0] < 1e13
    assert rates[1] == 0 or 1e8 < rates[1] < 1e13


@pytest.mark.parametrize("kwargs", [dict(nbytes=0, threads=1), dict(nbytes=SMALL, threads=0),
                                    dict(nbytes=SMALL, threads=1, passes=0)])
def test_per_worker_probe_rejects_empty_work(kwargs):
    with pytest.raises(ValueError, match="at least 1"):
        native.read_bandwidth_by_worker(**kwargs)


def test_native_probe_with_prefetches_reads_at_a_plausible_rate():
    bps = native.read_bandwidth(SMALL, 1, passes=3, rounds=1, prefetch=True)
    assert math.isfinite(bps) and 1e8 < bps < 1e13
