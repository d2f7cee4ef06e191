"""benchmarks/finetune.py sft in its CPU smoke mode: every setup trains LoRA adapters on a tiny checkpoint in a process
of its own and gets a row, a setup that fails shows its error in its row while the others complete, and the
accelerate setup's device_map puts exactly the routed-experts modules on the CPU."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import finetune
from benchmarks.lib.finetune_setups import empty_model, experts_on_cpu_device_map

pytest.importorskip("peft")
pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

SMOKE = ["sft", "--synthetic", "qwen3_moe:tiny", "--layers", "1", "--seq-len", "16", "--steps", "1", "--warmup", "1",
         "--device", "cpu"]


def rows_of(tmp_path, *extra: str) -> list[dict]:
    out = tmp_path / "finetune.json"
    assert finetune.main([*SMOKE, "--checkpoint-root", str(tmp_path), "--json", str(out), *extra]) == 0
    return json.loads(out.read_text())["rows"]


def test_every_setup_trains_and_gets_a_row(tmp_path, capsys):
    rows = rows_of(tmp_path)
    assert [row["setup"] for row in rows] == ["hybridmoe", "accelerate", "gpu"]
    for row in rows:
        assert "error" not in row and "skipped" not in row, row
        assert row["tokens_per_s"] > 0 and row["trainable_params"] > 0 and row["peak_rss_gib"] > 0
        assert row["lora_targets"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    by_setup = {row["setup"]: row for row in rows}
    assert by_setup["accelerate"]["x_accelerate"] == 1.0 and by_setup["gpu"]["x_gpu"] == 1.0
    assert "cpu_offload hooks" in by_setup["accelerate"]["note"]
    first_losses = [row["losses"][0] for row in rows]  # the same weights and tokens, before any update
    assert max(first_losses) - min(first_losses) < 0.02 * max(first_losses)
    printed = capsys.readouterr().out
    assert "x accel" in printed and "not judged" in printed


def test_a_failing_setup_shows_its_error_and_the_others_complete(tmp_path, capsys):
    rows = rows_of(tmp_path, "--setups", "hybridmoe,gpu", "--expert-format", "int3")
    failed, done = rows
    assert failed["setup"] == "hybridmoe" and "int3" in failed["error"] and "tokens_per_s" not in failed
    assert done["setup"] == "gpu" and done["tokens_per_s"] > 0 and "error" not in done
    assert "error:" in capsys.readouterr().out


def test_unknown_setups_are_refused_before_anything_runs(tmp_path, capsys):
    assert finetune.main([*SMOKE, "--setups", "hybridmoe,deepspeed"]) == 2
    assert "deepspeed" in capsys.readouterr().err


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_the_device_map_offloads_the_experts_modules_and_covers_the_rest(arch, tmp_path):
    from accelerate.utils import check_device_map

    from hybridmoe.checkpoint.presets import model_config
    from hybridmoe.hf.family_layouts import family_of

    config = transformers.AutoConfig.for_model(**model_config(arch, "tiny", layers=3))
    model = empty_model(config)
    device_map = experts_on_cpu_device_map(model, family_of(config, arch).experts_class, torch.device("cuda"))
    experts = {name for name, m in model.named_modules() if name.endswith("mlp.experts")}
    assert experts and {k for k, v in device_map.items() if v == "cpu"} == experts
    assert set(device_map.values()) == {"cpu", 0} and "" not in device_map
    check_device_map(model, device_map)  # every parameter placed
    assert not any(b.startswith(a + ".") for a in device_map for b in device_map)  # no key inside another
