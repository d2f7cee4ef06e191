"""DeepSeek directories as released: original config.json spelling, the V3 MTP layer, bad names.

Released DeepSeek checkpoints write `rope_scaling` {"type": "yarn", ...} beside a top-level
`rope_theta` (transformers 5 writes `rope_parameters`), and V3/R1 carry their multi-token
prediction module as one extra layer, model.layers.{num_hidden_layers}.*, which inference skips.
"""

import json

import pytest
import torch
from compare import assert_close, run_step, save_and_load
from deepseek_tiny import tiny_deepseek
from safetensors.torch import load_file, save_file

from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.errors import CheckpointError, HybridMoEError

PROMPT = [5, 17, 3, 60, 22, 9, 41]


def logits_of(model):
    model.allocate_kv_cache(1, len(PROMPT))
    return run_step(model, [PROMPT], slots=[0], start_pos=[0])[0]


def rewrite(path, config_edit=None, tensors_edit=None):
    if config_edit is not None:
        config = json.loads((path / "config.json").read_text())
        config_edit(config)
        (path / "config.json").write_text(json.dumps(config))
    if tensors_edit is not None:
        tensors = load_file(path / "model.safetensors")
        tensors_edit(tensors)
        save_file(tensors, path / "model.safetensors")


def to_original_spelling(config):
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    config["rope_scaling"] = rope
    # fields DeepSeek's own config carries that transformers' classes ignore
    config.update(topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1, ep_size=1,
                  auto_map={"AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})


def add_mtp_layer(tensors):
    n = 3  # TINY's num_hidden_layers: the MTP layer comes right after the last decoder layer
    for name, t in list(tensors.items()):
        if name.startswith("model.layers.2."):
            tensors[name.replace("model.layers.2.", f"model.layers.{n}.")] = t.clone()
    for extra in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                  "shared_head.head.weight", "embed_tokens.weight"):
        tensors[f"model.layers.{n}.{extra}"] = torch.ones(2, 2)


def test_original_config_spelling_and_mtp_layer_give_the_same_logits(tmp_path):
    hf = tiny_deepseek("v3", q_lora_rank=32, n_group=4, topk_group=2)
    want = logits_of(save_and_load(hf, tmp_path / "hf", dtype="float32").model)
    save_and_load(hf, tmp_path / "released", dtype="float32")
    rewrite(tmp_path / "released", to_original_spelling, add_mtp_layer)
    loaded = load_model(tmp_path / "released", EngineConfig(dtype="float32"))
    assert loaded.config.rope_parameters["rope_type"] == "yarn"
    assert_close(logits_of(loaded.model), want, what="logits")


def test_a_misnamed_tensor_is_named_in_the_error(tmp_path):
    save_and_load(tiny_deepseek("v2", q_lora_rank=None), tmp_path, dtype="float32")
    rewrite(tmp_path, tensors_edit=lambda t: t.update(
        {"model.layers.1.self_attn.kv_b_proj.wieght": t.pop("model.layers.1.self_attn.kv_b_proj.weight")}))
    with pytest.raises(CheckpointError, match=r"kv_b_proj\.wieght"):
        load_model(tmp_path)


def test_an_unsupported_rope_type_is_a_one_line_error(tmp_path):
    save_and_load(tiny_deepseek("v2"), tmp_path, dtype="float32")
    rewrite(tmp_path, lambda c: c["rope_parameters"].update(rope_type="longrope"))
    with pytest.raises(HybridMoEError, match="longrope"):
        load_model(tmp_path)
