import json
import sys

import pytest

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
