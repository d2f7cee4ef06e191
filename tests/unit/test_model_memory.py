"""A config whose weights can never fit this machine, or that claims more layers than its checkpoint has, fails
before anything is read or built."""

import json
import re
import shutil
import tracemalloc

import pytest
import torch

from hybridmoe.checkpoint.presets import model_config
from hybridmoe.engine.model_loader import load_model
from hybridmoe.errors import CheckpointError, HybridMoEError
from hybridmoe.models.param_count import param_count
from hybridmoe.models.registry import get_model_class
from hybridmoe.system.host import meminfo
from hybridmoe.system.model_memory import gpu_memory, weights_floor

GIB = r"[\d.]+ GiB"


@pytest.mark.parametrize("changes", [{"hidden_size": 10**9},
                                     {"num_hidden_layers": 10**6, "moe_intermediate_size": 4096}])
def test_weights_past_the_memory_fail_before_the_checkpoint_is_opened(tmp_path, changes):
    # no weight files: a check made after opening the checkpoint would report those missing instead
    (tmp_path / "config.json").write_text(json.dumps({**model_config("qwen3_moe", "tiny", dtype="fp32"), **changes}))
    tracemalloc.start()
    try:
        with pytest.raises(HybridMoEError) as e:
            load_model(tmp_path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert re.fullmatch(
        rf"{re.escape(str(tmp_path / 'config.json'))} describes at least {GIB} of weights \({GIB} in float32 besides "
        rf"the routed experts, {GIB} of routed experts at 4 bits\), more than this machine's {GIB} of memory; check "
        r"its sizes \(num_hidden_layers \d+, hidden_size \d+, vocab_size \d+, \.\.\.\)", str(e.value))
    assert peak < 32 << 20  # no per-layer Python objects, no layer list of the config's length


def test_the_floor_is_the_model_in_its_dtype_and_the_experts_at_4_bits():
    raw = model_config("deepseek_v3", "deepseek-v3")
    cls = get_model_class(raw["architectures"][0])
    config = cls.make_config(raw)
    count = param_count(cls, config)
    assert weights_floor(cls, config, torch.bfloat16, experts_mapped=False) == (2 * count.model,
                                                                                count.routed_experts // 2)
    assert weights_floor(cls, config, torch.bfloat16, experts_mapped=True) == (2 * count.model, 0)
    # DeepSeek-V3: 671B parameters, of which 654B in routed experts
    assert 660e9 < count.model + count.routed_experts < 680e9 and 650e9 < count.routed_experts < 660e9


def test_a_model_that_fits_loads(tiny_qwen3_fp32):
    raw = json.loads((tiny_qwen3_fp32 / "config.json").read_text())
    cls = get_model_class(raw["architectures"][0])
    assert 0 < sum(weights_floor(cls, cls.make_config(raw), torch.float32, False)) < meminfo()[0]
    assert load_model(tiny_qwen3_fp32).config.num_hidden_layers == 2


def test_the_cpu_adds_no_gpu_memory():
    assert gpu_memory("cpu") == 0 and gpu_memory("not a device") == 0


def test_more_layers_than_the_checkpoint_holds_fail_before_the_build(tiny_qwen3_fp32, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(tiny_qwen3_fp32, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 5000}))
    with pytest.raises(CheckpointError) as e:
        load_model(path)
    assert str(e.value) == (f"{path / 'config.json'} has num_hidden_layers 5000, but the checkpoint ends at "
                            "model.layers.1")
