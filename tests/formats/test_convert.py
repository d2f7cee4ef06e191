"""`hybridmoe convert` output loads to the same logits as packing the source at load time."""

import json

import pytest
import torch

from hybridmoe.cli import main
from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.errors import HybridMoEError
from hybridmoe.forward_context import Context, use_context
from hybridmoe.weights.convert import convert_checkpoint
from hybridmoe.weights.expert_cache import read_manifest

PROMPT = [5, 17, 3, 60, 22, 9, 41]


def native(fmt="int4", group=32, **kw):
    return EngineConfig(expert_backend="native", expert_format=fmt, expert_group_size=group, cpu_threads=1,
                        dtype="float32", cache_dir="", **kw)


@torch.no_grad()
def logits(loaded):
    """Prompt logits [T, V] of a freshly loaded model."""
    model = loaded.model
    model.allocate_kv_cache(1, 16)
    with use_context(Context(slot_ids=[0], start_pos=[0], cu_seqlens=[0, len(PROMPT)])):
        return model.compute_logits(model(torch.tensor(PROMPT), torch.arange(len(PROMPT))))


@pytest.mark.parametrize("fmt,group", [("int4", 32), ("int8", 128), ("bf16", 128)])
def test_converted_dir_gives_the_logits_of_packing_at_load(tiny_qwen3, tmp_path, fmt, group):
    out = tmp_path / "conv"
    summary = convert_checkpoint(tiny_qwen3, out, format=fmt, group_size=group, threads=1, progress=False)
    assert summary.moe_layers == 2
    assert not list(out.glob("*experts*.safetensors")) and len(list((out / "experts").iterdir())) == 2
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert not any(".experts." in name for name in index)  # experts live only in packed form
    want = logits(load_model(tiny_qwen3, native(fmt, group)))
    got = logits(load_model(out, native(fmt, group)))
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_converted_dir_needs_matching_engine_options(tiny_qwen3, tmp_path):
    out = tmp_path / "conv"
    convert_checkpoint(tiny_qwen3, out, format="int4", group_size=32, threads=1, progress=False)
    with pytest.raises(HybridMoEError, match="--expert-format int4 --expert-group-size 32"):
        load_model(out, native("int4", 128))
    with pytest.raises(HybridMoEError, match="--expert-backend native"):
        load_model(out, EngineConfig(expert_backend="torch", dtype="float32", cache_dir=""))


def test_converted_dir_loads_with_default_engine_options(tiny_qwen3, tmp_path):
    out = tmp_path / "conv"
    convert_checkpoint(tiny_qwen3, out, format="int4", group_size=32, threads=1, progress=False)
    # expert_backend and expert_format "auto" take what the directory was converted for
    want = logits(load_model(out, native("int4", 32)))
    torch.testing.assert_close(logits(load_model(out, EngineConfig(cpu_threads=1, dtype="float32", cache_dir=""))),
                               want, atol=0, rtol=0)


def test_convert_cli_refuses_to_overwrite_without_force(tiny_qwen3, tmp_path, capsys):
    out = tmp_path / "conv"
    args = ["convert", "--model", str(tiny_qwen3), "--format", "int8", "--out", str(out), "--quiet",
            "--cpu-threads", "1"]
    assert main(args) == 0
    assert "in int8 (" in capsys.readouterr().out
    assert main(args) == 2
    assert "already holds a converted model; pass --force" in capsys.readouterr().err
    assert main(args + ["--force"]) == 0
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert main(args[:-4] + [str(other), "--quiet", "--force"]) == 2
    assert "is not empty; pick a new directory" in capsys.readouterr().err
    assert (other / "notes.txt").read_text() == "mine"


def test_convert_cli_defaults_to_what_a_load_picks(tiny_qwen3, tmp_path, capsys):
    # a float checkpoint loads its experts in bf16 (weights/native_format.py)
    assert main(["convert", "--model", str(tiny_qwen3), "--out", str(tmp_path / "conv"), "--quiet"]) == 0
    assert "in bf16 (" in capsys.readouterr().out
    assert read_manifest(tmp_path / "conv")["format"] == "bf16"
