import json
import sys

import pytest
import torch

from benchmarks.lib.peers_kt import run_kt
from benchmarks.lib.peers_kt_worker import KtUnavailable, load_extension


def test_no_kt_kernel_says_where_it_comes_from(tmp_path):
    with pytest.raises(KtUnavailable, match="peers.py sources"):
        load_extension(tmp_path)


def test_extensions_for_another_python_say_which(tmp_path):
    package = tmp_path / "kt_kernel"
    package.mkdir()
    (package / "_cpu_detect.py").write_text("")
    (package / "_kt_kernel_ext_amx.cpython-39-x86_64-linux-gnu.so").write_bytes(b"")
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    with pytest.raises(KtUnavailable, match=rf"built for cpython-39; this is Python {here}"):
        load_extension(tmp_path)


def test_kt_kernels_failure_comes_back_as_a_result_not_an_exception(tmp_path):
    spec = dict(kt_dir=str(tmp_path), format="int8", E=8, H=64, I=32, K=2, tokens=[1], threads=1, reps=1,
                budget_s=0.1, outputs=str(tmp_path / "out.pt"))
    result = run_kt(spec, sys.executable, timeout_s=120)
    assert set(result) == {"error"} and "no kt-kernel in" in result["error"]
    json.dumps(result)


def test_decode_calls_never_find_the_previous_calls_experts():
    from benchmarks.lib.peers_kt_calls import timed_ms, windowed_routings

    calls = windowed_routings(4, 16, 128, 8, seed=0)
    assert len(calls) == 4
    sets = [set(ids.flatten().tolist()) for _, ids, _ in calls]
    for a, b in zip(sets, sets[1:] + sets[:1]):
        assert not a & b
    for _, ids, w in calls:
        assert all(len(set(row.tolist())) == 8 for row in ids) and torch.allclose(w.sum(-1), torch.ones(4))
    assert windowed_routings(4, 16, 32, 8, seed=0) is None  # one window only: the caches are flushed instead

    seen = []
    ms, experts = timed_ms(lambda x, ids, w: seen.append(ids), 1, 16, 64, 8, reps=10, budget_s=10.0)
    assert ms >= 0 and experts == 8
    assert len(seen) == 8 + 10  # one untimed pass over the 8 windows, then the timed calls
    assert all(not set(a.flatten().tolist()) & set(b.flatten().tolist()) for a, b in zip(seen, seen[1:]))
