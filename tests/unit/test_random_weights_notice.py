"""make-model marks its checkpoints as random in config.json; run, chat and bench then say, in one line beside
the engine's choices, that the text is noise, and say nothing of the kind for a checkpoint without the mark."""

import io
import json
import shutil

import pytest

from hybridmoe.checkpoint import RANDOM_WEIGHTS_KEY
from hybridmoe.cli import main
from hybridmoe.commands.doctor import RANDOM_WEIGHTS_LINE
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.errors import CheckpointError
from hybridmoe.models.registry import load_config

RUN = ["--prompt", "Hi", "--max-new-tokens", "2", "--expert-backend", "torch"]
BENCH = ["--prompt-len", "4", "--gen-len", "2", "--expert-backend", "torch"]


@pytest.fixture(scope="module")
def unmarked(tiny_qwen3_fp32, tmp_path_factory):
    """The tiny checkpoint with make-model's mark taken out of its config.json, as a real model's is."""
    d = tmp_path_factory.mktemp("unmarked") / "model"
    shutil.copytree(tiny_qwen3_fp32, d)
    config = json.loads((d / "config.json").read_text())
    del config[RANDOM_WEIGHTS_KEY]
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_make_model_writes_the_mark(tmp_path, capsys):
    out = tmp_path / "m"
    assert main(["make-model", "--arch", "qwen2_moe", "--preset", "tiny", "--out", str(out), "--quiet"]) == 0
    assert json.loads((out / "config.json").read_text())[RANDOM_WEIGHTS_KEY] is True
    _, config = load_config(out)  # the config check takes it
    assert config.get(RANDOM_WEIGHTS_KEY) is True


def test_the_config_check_wants_the_mark_true_or_false(unmarked, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(unmarked, d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, RANDOM_WEIGHTS_KEY: "yes"}))
    with pytest.raises(CheckpointError, match=f"{RANDOM_WEIGHTS_KEY} must be true or false or null"):
        load_config(d)


def test_the_engine_exposes_the_mark(tiny_qwen3_fp32, unmarked):
    assert LLMEngine(tiny_qwen3_fp32).random_weights is True
    assert LLMEngine(unmarked).random_weights is False


def test_run_says_the_weights_are_random_beside_its_choices(tiny_qwen3_fp32, unmarked, capsys):
    assert main(["run", "--model", str(tiny_qwen3_fp32), *RUN]) == 0
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert lines[0].startswith("choices:") and lines[1] == RANDOM_WEIGHTS_LINE and "noise" not in out
    assert main(["run", "--model", str(unmarked), *RUN]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines()[0].startswith("choices:") and RANDOM_WEIGHTS_LINE not in err + out


def test_chat_says_the_weights_are_random(tiny_qwen3_fp32, unmarked, capsys, monkeypatch):
    for model, said in ((tiny_qwen3_fp32, True), (unmarked, False)):
        monkeypatch.setattr("sys.stdin", io.StringIO("/exit\n"))
        assert main(["chat", "--model", str(model), "--expert-backend", "torch"]) == 0
        out, err = capsys.readouterr()
        assert (RANDOM_WEIGHTS_LINE in err.splitlines()) is said and RANDOM_WEIGHTS_LINE not in out


def test_bench_says_the_weights_are_random_and_records_it(tiny_qwen3_fp32, unmarked, tmp_path, capsys):
    for model, said in ((tiny_qwen3_fp32, True), (unmarked, False)):
        out_json = tmp_path / f"{said}.json"
        assert main(["bench", "--model", str(model), *BENCH, "--json", str(out_json)]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].startswith("choices:") and (lines[1] == RANDOM_WEIGHTS_LINE) is said
        assert json.loads(out_json.read_text())["setup"]["random_weights"] is said


def test_doctor_says_the_weights_are_random(tiny_qwen3_fp32, unmarked, tmp_path, capsys):
    for model, said in ((tiny_qwen3_fp32, True), (unmarked, False)):
        out_json = tmp_path / f"{said}.json"
        assert main(["doctor", "--model", str(model), "--measure-bytes", "1MiB", "--json", str(out_json)]) == 0
        assert (RANDOM_WEIGHTS_LINE in capsys.readouterr().out.splitlines()) is said
        assert json.loads(out_json.read_text())["model"]["random_weights"] is said
