"""Peak RSS while loading a checkpoint: the packed experts plus a little, never the checkpoint's mapped
pages or a stacked copy of a layer beside them (issue #3: <= 1.2x packed + 2 GiB at DeepSeek-V3's size).

A one-layer Qwen3-MoE checkpoint with 200 MB of bf16 experts loads in a fresh process (its own VmHWM),
after a tiny model's load (what a process pays once, ~80 MB of imports and threads, is not the load's).
The margin, 32 MiB, holds the model's other weights (5 MB) and one expert's float32 copy (6 MB). The
source pages alone would be 200 MB (RssFile on disk, RssShmem in /dev/shm), a stacked copy 200 more.
"""

import shutil
import tempfile
from pathlib import Path

import pytest

from hybridmoe.bench.load_rss import measure_in_subprocess, write_one_layer

MARGIN = 32 << 20
LAYER = {"hidden_size": 1024, "moe_intermediate_size": 512, "num_experts": 64, "head_dim": 64,
         "num_attention_heads": 8, "num_key_value_heads": 2}
SOURCE_BYTES = 64 * 3 * 1024 * 512 * 2


def _write(out: Path) -> Path:
    out.mkdir()
    assert write_one_layer(out, "qwen3_moe", "tiny", **LAYER) == SOURCE_BYTES
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("load-rss-warmup")
    write_one_layer(out, "qwen3_moe", "tiny")
    return out


@pytest.fixture(scope="module")
def on_disk(tmp_path_factory) -> Path:
    return _write(tmp_path_factory.mktemp("load-rss") / "model")


@pytest.fixture
def in_shm():
    shm = Path("/dev/shm")
    if not shm.is_dir():
        pytest.skip("no /dev/shm")
    out = _write(Path(tempfile.mkdtemp(dir=shm)) / "model")
    yield out
    shutil.rmtree(out.parent)


def _load(model_dir: Path, fmt: str, warmup_dir: Path, **options) -> dict:
    return measure_in_subprocess(model_dir, {"device": "cpu", "expert_backend": "native", "expert_format": fmt,
                                             "expert_group_size": 32, "cache_dir": "", "cpu_threads": 2, **options},
                                 warmup_dir, timeout=300)


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_peak_rss_of_a_load_from_disk_is_the_packed_experts(on_disk, tiny, fmt):
    r = _load(on_disk, fmt, tiny)
    assert r["peak_growth"] <= 1.2 * r["packed_bytes"] + MARGIN, r
    assert r["at_peak"]["RssFile"] < MARGIN, r


def test_peak_rss_of_a_load_from_tmpfs_is_the_packed_experts(in_shm, tiny):
    r = _load(in_shm, "bf16", tiny)
    assert r["peak_growth"] <= 1.2 * r["packed_bytes"] + MARGIN, r
    assert r["at_peak"]["RssShmem"] < MARGIN, r


def test_peak_rss_of_a_hybrid_load_is_its_two_shares(on_disk, tiny):
    # 8 of 64 experts "on the GPU" (the CPU stands in: they stay in RSS, in bf16) and 56 packed for the CPU
    # engine: together the source's size, with no stacked layer or per-share copy beside them.
    r = _load(on_disk, "bf16", tiny, gpu_experts_per_layer=8)
    assert r["packed_bytes"] == SOURCE_BYTES * 56 // 64
    assert r["peak_growth"] <= 1.2 * SOURCE_BYTES + MARGIN, r
