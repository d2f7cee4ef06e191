"""The parameters counted from a config alone equal those of the model built from it (on the meta device)."""

import pytest
import torch

from hybridmoe.checkpoint.presets import PRESETS, model_config
from hybridmoe.experts.torch_ref import TorchExperts
from hybridmoe.models.param_count import param_count
from hybridmoe.models.registry import get_model_class

VARIANTS = {
    "as is": {},
    "tied": {"tie_word_embeddings": True},
    "deeper": {"num_hidden_layers": 7},
    # every second layer sparse, some dense by list (Qwen); biases and MoE every third layer (DeepSeek)
    "sparse steps": {"num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [0, 1, 3],
                     "attention_bias": True, "moe_layer_freq": 3, "first_k_dense_replace": 2, "q_lora_rank": None},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("family, preset", [(f, p) for f in PRESETS for p in PRESETS[f]])
def test_counts_match_the_built_model(family, preset, variant):
    # a depth the preset's layer_types must follow (gpt-oss lists one per layer): model_config repeats its pattern
    raw = {**model_config(family, preset, layers=VARIANTS[variant].get("num_hidden_layers")), **VARIANTS[variant]}
    if raw.get("index_n_heads"):  # DeepSeek-V3.2's indexer reads the q latent: q_lora_rank stays
        raw["q_lora_rank"] = model_config(family, preset)["q_lora_rank"]
    cls = get_model_class(raw["architectures"][0])
    config = cls.make_config(raw)
    with torch.device("meta"):
        model = cls(config, TorchExperts())
    E, inter = model.expert_dims()
    count = param_count(cls, config)
    assert count.model == sum(p.numel() for p in model.parameters())
    assert count.routed_experts == len(model.moe_layers) * E * 3 * config.hidden_size * inter


def test_a_million_layers_are_counted_without_building_them():
    raw = {**model_config("qwen3_moe", "tiny"), "num_hidden_layers": 10**6}
    cls = get_model_class(raw["architectures"][0])
    one = param_count(cls, cls.make_config({**raw, "num_hidden_layers": 1}))
    many = param_count(cls, cls.make_config(raw))
    embeddings = 2 * raw["vocab_size"] * raw["hidden_size"] + raw["hidden_size"]
    assert many.model - embeddings == 10**6 * (one.model - embeddings)
    assert many.routed_experts == 10**6 * one.routed_experts
