"""int4 groups that do not divide a model's hidden and expert intermediate sizes fail before any packing, in one
line naming the option (and flag) that fixes it: the group size that divides both, or int8 when none does."""

import pytest

from hybridmoe.cli import main
from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.errors import HybridMoEError
from hybridmoe.weights.native_format import check_int4_group


def test_load_names_the_group_size_that_fits(tiny_qwen3):
    # tiny: hidden 64, expert intermediate 32
    options = EngineConfig(expert_backend="native", expert_format="int4", expert_group_size=128, cache_dir="")
    with pytest.raises(HybridMoEError, match=r"\(64\) and the experts' intermediate size \(32\) divisible by the "
                                             r"group: set expert_group_size to 32 \(--expert-group-size 32\)$"):
        load_model(tiny_qwen3, options)


def test_convert_names_its_own_flag_and_writes_nothing(tiny_qwen3, tmp_path, capsys):
    out = tmp_path / "conv"
    assert main(["convert", "--model", str(tiny_qwen3), "--format", "int4", "--group-size", "64", "--out", str(out),
                 "--quiet"]) == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert "int4 in groups of 64 needs" in error and error.endswith("pass group_size 32 (--group-size 32)")
    assert not out.exists()


def test_no_group_size_fits():
    with pytest.raises(HybridMoEError, match=r"use int8 \(no int4 group size divides both\)$"):
        check_int4_group(32, 64, 24, "group {g}", "use int8")
