import json

import pytest

from hybridmoe.bench.synthetic import (
    arch_of_preset,
    full_config,
    split_preset,
    synthetic_checkpoint,
)
from hybridmoe.errors import HybridMoEError


def test_a_real_preset_name_finds_its_architecture():
    assert arch_of_preset("qwen3-30b-a3b") == "qwen3_moe"
    assert arch_of_preset("deepseek-v3") == "deepseek_v3"
    assert arch_of_preset("glm-4.5-air") == "glm4_moe"
    assert arch_of_preset("minimax-m2") == "minimax_m2"
    assert split_preset("mixtral:tiny") == ("mixtral", "tiny")
    assert full_config("deepseek-v3")["num_hidden_layers"] == 61


@pytest.mark.parametrize("spec", ["tiny", "qwen4-1t", "qwen3_moe:huge"])
def test_an_ambiguous_or_unknown_preset_is_a_one_line_error(spec):
    with pytest.raises(HybridMoEError) as e:
        split_preset(spec)
    assert "\n" not in str(e.value)


def test_the_checkpoint_lives_only_inside_the_context(tmp_path):
    with synthetic_checkpoint("qwen3_moe:tiny", layers=1, root=tmp_path) as ckpt:
        assert ckpt.out_dir.parent == tmp_path
        config = json.loads((ckpt.out_dir / "config.json").read_text())
        assert config["num_hidden_layers"] == 1 and ckpt.shards
    assert not ckpt.out_dir.exists()
