import argparse
import json

import pytest
import torch

from benchmarks import quality
from benchmarks.lib import route_prediction
from hybridmoe.bench.prompts import load_reference
from hybridmoe.checkpoint.make import make_checkpoint


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])
def model(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    make_checkpoint(request.param, "tiny", out, dtype="fp32", seed=3, force=True, progress=False)
    return load_reference(str(out), argparse.Namespace(dtype="float32", prompt_len=48)).model


def test_overlap_counts_the_shared_ids_per_token():
    got = route_prediction.overlap(torch.tensor([[1, 2], [3, 4]]), torch.tensor([[2, 5], [4, 3]]))
    assert got.tolist() == [0.5, 1.0]


def test_the_prediction_is_exact_when_attention_adds_nothing(model):
    prompt = torch.randint(0, model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    before = route_prediction.prompt_overlaps(model, prompt)
    assert set(before) == set(model.moe_layers)
    assert min(float(s.mean()) for s in before.values()) < 1.0  # attention moves the routing: not vacuous
    saved = [layer.self_attn.o_proj.weight.detach().clone() for layer in model.model.layers]
    try:
        for layer in model.model.layers:  # each layer's residual after attention is then its input
            layer.self_attn.o_proj.weight.data.zero_()
        exact = route_prediction.prompt_overlaps(model, prompt)
    finally:
        for layer, weight in zip(model.model.layers, saved):
            layer.self_attn.o_proj.weight.data.copy_(weight)
    assert all(s.shape == (40,) and bool((s == 1.0).all()) for s in exact.values())


def test_main_writes_one_row_per_model(tmp_path, capsys):
    out = tmp_path / "rp.json"
    assert quality.main(["route-prediction", "--synthetic", "mixtral:tiny", "--prompts", "1", "--prompt-len", "16",
                         "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["model_type"] == "mixtral" and row["positions"] == 16
    assert row["random_guess"] == row["experts_per_token"] / row["experts"]
    assert 0.0 <= row["mean_overlap"] <= 1.0 and len(row["per_layer"]) == row["layers"]
    assert "mixtral" in capsys.readouterr().out
