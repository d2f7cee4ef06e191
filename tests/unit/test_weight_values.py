"""A weight the model or its experts receive is a float tensor without NaN or Inf; otherwise one CheckpointError
line names the tensor."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridmoe.engine.model_loader import load_model
from hybridmoe.errors import CheckpointError
from hybridmoe.weights.loader import checked_weight

NORM = "model.norm.weight"
ATTENTION = "model.layers.1.self_attn.o_proj.weight"
EXPERT = "model.layers.0.mlp.experts.3.down_proj.weight"


@pytest.fixture
def ckpt(tiny_qwen3_fp32, tmp_path):
    shutil.copytree(tiny_qwen3_fp32, tmp_path / "model")
    return tmp_path / "model"


def edit_tensor(path, name, edit):
    for file in path.glob("*.safetensors"):
        tensors = load_file(file)
        if name in tensors:
            tensors[name] = edit(tensors[name])
            save_file(tensors, file, metadata={"format": "pt"})
            return
    raise KeyError(name)


def load_error(path) -> str:
    with pytest.raises(CheckpointError) as e:
        load_model(path)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("name", [NORM, ATTENTION, EXPERT])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int8, torch.bool])
def test_an_integer_tensor_where_a_float_weight_belongs_is_named(ckpt, name, dtype):
    edit_tensor(ckpt, name, lambda t: t.to(dtype))
    want = f"tensor {name} has dtype {str(dtype).removeprefix('torch.')}, where a float weight is expected"
    assert load_error(ckpt) == want


@pytest.mark.parametrize("name", [NORM, ATTENTION, EXPERT])
@pytest.mark.parametrize("bad, what", [(float("nan"), "NaN"), (float("inf"), "infinite values"),
                                       (float("-inf"), "infinite values")])
def test_nan_or_inf_in_a_weight_is_named(ckpt, name, bad, what):
    def poison(t):
        t = t.clone()
        t.view(-1)[t.numel() // 2] = bad
        return t

    edit_tensor(ckpt, name, poison)
    assert load_error(ckpt) == f"tensor {name} holds {what}; the checkpoint file is damaged"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                   torch.float8_e4m3fn])
@pytest.mark.parametrize("numel", [1, 7, 64, 1000, 4099])
def test_every_position_of_a_bad_value_is_seen(dtype, numel):
    # odd sizes leave tails past any vector width; FP8 e4m3fn has NaN but no Inf
    for bad in (float("nan"), float("inf"), float("-inf")) if dtype != torch.float8_e4m3fn else (float("nan"),):
        for i in {0, numel // 2, numel - 1}:
            t = torch.linspace(-1, 1, numel).to(dtype)
            t[i] = bad
            with pytest.raises(CheckpointError, match="tensor w holds"):
                checked_weight("w", t)
    clean = torch.linspace(-1, 1, numel).to(dtype)
    assert checked_weight("w", clean) is clean


def test_an_empty_tensor_is_fine():
    assert checked_weight("w", torch.empty(0, 4)).shape == (0, 4)
