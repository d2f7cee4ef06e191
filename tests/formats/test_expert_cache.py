"""A first start with int4 experts packs and caches them; the next start maps the cache instead of packing."""

import warnings

import pytest
import torch

from hybridmoe.config import EngineConfig
from hybridmoe.experts.cpu_experts import CpuExperts
from hybridmoe.weights.loader import load_model


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
