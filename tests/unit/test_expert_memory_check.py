"""A load whose packed CPU experts would not fit the machine's memory fails before reading them, naming the
formats that would fit; one that fits the memory but not what is available now warns; doctor says which.
(The tiny model's experts take 60-192 KiB; the machine's memory is made smaller than that.)"""

import pytest

import hybridmoe.system.expert_memory as expert_memory
from hybridmoe.checkpoint import make_checkpoint
from hybridmoe.cli import main
from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.errors import HybridMoEError

KIB = 1 << 10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "model"
    make_checkpoint("qwen3_moe", "tiny", out, dtype="bf16", seed=1, progress=False)
    return out


def load(path, **options):
    return load_model(path, EngineConfig(expert_backend="native", expert_format="bf16", cpu_threads=1,
                                         cache_dir="", **options))


def test_experts_larger_than_the_memory_fail_before_packing(tiny, monkeypatch):
    monkeypatch.setattr(expert_memory, "meminfo", lambda: (150 * KIB, 120 * KIB))
    with pytest.raises(HybridMoEError, match=r"^the routed experts packed for the CPU in bf16 take 192\.00 KiB, more "
                                             r"than this machine's 150\.00 KiB of memory; use expert_format int8 "
                                             r"\(--expert-format int8: [\d.]+ KiB\) or expert_format int4 "):
        load(tiny)


def test_experts_larger_than_the_memory_available_warn(tiny, monkeypatch):
    monkeypatch.setattr(expert_memory, "meminfo", lambda: (1 << 30, 150 * KIB))
    with pytest.warns(UserWarning, match=r"more than the 150\.00 KiB of memory available now"):
        load(tiny)


def test_experts_on_the_gpu_are_not_counted(tiny, monkeypatch):
    # 6 of each layer's 8 experts "on the GPU" (the CPU stands in): the CPU's 48 KiB fit
    monkeypatch.setattr(expert_memory, "meminfo", lambda: (150 * KIB, 120 * KIB))
    load(tiny, gpu_experts_per_layer=6)


def test_doctor_says_whether_they_fit(tiny, monkeypatch, capsys):
    monkeypatch.setattr(expert_memory, "meminfo", lambda: (150 * KIB, 120 * KIB))
    assert main(["doctor", "--model", str(tiny), "--measure-bytes", "1MiB", "--expert-backend", "native"]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("memory:")]
    assert line.endswith("in bf16: 192.00 KiB of 120.00 KiB available (150.00 KiB total); too large: use "
                         "expert_format int8 (--expert-format int8: 104.00 KiB) or expert_format int4 "
                         "(--expert-format int4 --expert-group-size 32: 60.00 KiB)"), line
