"""A first start with int4 experts packs and caches them; the next start maps the cache instead of packing.
Caching never fills the disk, and entries no start can read any more are dropped."""

import os
import shutil
import warnings

import pytest
import torch

from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.experts.cpu_experts import CpuExperts


def options(cache_dir, group=32):
    return EngineConfig(expert_backend="native", expert_format="int4", expert_group_size=group, cpu_threads=1,
                        dtype="float32", cache_dir=str(cache_dir))


def first_expert(loaded, layer=0):
    return loaded.experts.layer_experts(layer).dequantized(0)


def refuse_packing(*args, **kwargs):
    raise AssertionError("experts were packed again instead of read from the cache")


def test_second_start_reuses_the_cache(tiny_qwen3, tmp_path, monkeypatch):
    first = load_model(tiny_qwen3, options(tmp_path))
    entries = list((tmp_path / "experts").iterdir())
    assert len(entries) == 1 and (entries[0] / "hybridmoe_experts.json").is_file()
    monkeypatch.setattr(CpuExperts, "__init__", refuse_packing)
    second = load_model(tiny_qwen3, options(tmp_path))
    for a, b in zip(first_expert(first), first_expert(second)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_other_options_get_their_own_entry(tiny_qwen3, tmp_path):
    load_model(tiny_qwen3, options(tmp_path, group=32))
    load_model(tiny_qwen3, EngineConfig(expert_backend="native", expert_format="int8", cpu_threads=1,
                                        dtype="float32", cache_dir=str(tmp_path)))
    assert len(list((tmp_path / "experts").iterdir())) == 2


def test_a_corrupt_entry_is_rebuilt_with_a_warning(tiny_qwen3, tmp_path):
    want = first_expert(load_model(tiny_qwen3, options(tmp_path)))
    (entry,) = (tmp_path / "experts").iterdir()
    layer = entry / "experts" / "layer-00000.safetensors"
    layer.write_bytes(layer.read_bytes()[:-10])
    with pytest.warns(UserWarning, match="ignoring the packed-expert cache entry"):
        got = first_expert(load_model(tiny_qwen3, options(tmp_path)))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_model(tiny_qwen3, options(tmp_path))  # rebuilt: read back without complaint


def test_empty_cache_dir_turns_caching_off(tiny_qwen3, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    load_model(tiny_qwen3, options(""))
    assert not any(tmp_path.iterdir())


def test_no_entry_when_the_disk_would_be_left_nearly_full(tiny_qwen3, tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    # 5% free: room for this tiny entry, but less than the 10% the cache leaves free
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=usage.total // 20))
    with pytest.warns(UserWarning, match=r"not caching the packed experts .* the cache leaves 10% free"):
        load_model(tiny_qwen3, options(tmp_path))
    assert not (tmp_path / "experts").exists()


def test_a_changed_checkpoint_drops_its_unreachable_entry(tiny_qwen3, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_qwen3, model)
    cache = tmp_path / "cache"
    load_model(model, options(cache))
    (old,) = (cache / "experts").iterdir()
    weights = sorted(model.glob("*.safetensors"))[0]
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # re-downloaded
    load_model(model, options(cache))
    (new,) = (cache / "experts").iterdir()
    assert new != old


def test_an_entry_whose_checkpoint_is_gone_is_dropped_and_others_stay(tiny_qwen3, tmp_path):
    gone, other = tmp_path / "gone", tmp_path / "other"
    shutil.copytree(tiny_qwen3, gone)
    shutil.copytree(tiny_qwen3, other)
    cache = tmp_path / "cache"
    load_model(gone, options(cache))
    load_model(other, options(cache, group=32))
    kept = set((cache / "experts").iterdir())
    shutil.rmtree(gone)
    load_model(tiny_qwen3, options(cache))
    entries = set((cache / "experts").iterdir())
    assert len(entries) == 2 and len(entries & kept) == 1
