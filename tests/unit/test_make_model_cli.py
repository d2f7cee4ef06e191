"""`hybridmoe make-model` from the command line: it writes a checkpoint, and user mistakes come
back as one-line errors (exit code 2) that say what to do."""

import json

import pytest

from hybridmoe.cli import main


def _make(out, *extra):
    return main(["make-model", "--arch", "mixtral", "--preset", "tiny", "--out", str(out), "--quiet", *extra])


def test_cli_writes_a_checkpoint(tmp_path, capsys):
    assert _make(tmp_path / "m", "--layers", "1", "--dtype", "fp32", "--seed", "7") == 0
    assert "MixtralForCausalLM tiny, 1 layers" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["torch_dtype"] == "float32"
    for name in ["generation_config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json"]:
        assert (tmp_path / "m" / name).is_file()


@pytest.mark.parametrize("args, message", [
    (["--preset", "mixtral-8x22b"], "unknown preset 'mixtral-8x22b' for mixtral; choose one of: tiny, mixtral-8x7b"),
    (["--preset", "tiny", "--layers", "0"], "--layers must be at least 1"),
    (["--preset", "tiny", "--mtp-layers", "1"],
     "--mtp-layers: mixtral has no multi-token-prediction module here (qwen3_next, qwen3_5_moe do)"),
])
def test_bad_arguments_are_one_line_errors(tmp_path, capsys, args, message):
    argv = ["make-model", "--arch", "mixtral", "--out", str(tmp_path / "m"), "--quiet", *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "m").exists()


def test_non_empty_out_dir_needs_force(tmp_path, capsys):
    out = tmp_path / "m"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert _make(out) == 2
    err = capsys.readouterr().err
    assert "exists and is not empty" in err and "--force" in err
    assert not (out / "config.json").exists()
    assert _make(out, "--force") == 0
    assert (out / "config.json").is_file() and (out / "notes.txt").read_text() == "mine"


def test_force_removes_shards_of_a_previous_checkpoint(tmp_path):
    out = tmp_path / "m"
    assert _make(out) == 0
    stale = out / "model-00001-of-00009.safetensors"
    stale.write_bytes(b"old")
    assert _make(out, "--force", "--layers", "1") == 0
    assert not stale.exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert {p.name for p in out.glob("model-*.safetensors")} == set(index["weight_map"].values())


def test_mtp_layers_write_the_module_that_mtp_loads(tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["make-model", "--arch", "qwen3_next", "--preset", "tiny", "--out", str(out), "--quiet",
                 "--mtp-layers", "1"]) == 0
    assert json.loads((out / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(name.startswith("mtp.layers.0.") for name in index) and "mtp.fc.weight" in index
    capsys.readouterr()
    assert main(["run", "--model", str(out), "--mtp", "--prompt", "hi", "--max-new-tokens", "2"]) == 0
