"""Qwen3.5-MoE's text model equals transformers' Qwen3_5MoeForCausalLM in float32: logits and hidden states over a
prompt longer than the delta rule's chunk, greedy tokens through the engine with chunked prefill, make-model's tiny;
and the text part of a multimodal checkpoint (Qwen3_5MoeForConditionalGeneration) equals that model on text.

Each case is a tiny random model of transformers' own class with both layer kinds (Gated DeltaNet and gated
attention), its weights redrawn at O(1) scale (test_qwen3_next.randomize), saved and loaded back by us.
"""

import json

import pytest
import torch
from compare import (
    assert_batched_decode_equals_recomputation,
    assert_forward_equals_transformers,
    hf_forward,
    run_step,
    save_and_load,
)
from safetensors.torch import load_file, save_file
from test_qwen3_next import GREEDY, LONG, PROMPTS, hf_greedy, randomize
from transformers import (
    AutoModelForCausalLM,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeTextConfig,
)

from hybridmoe import LLM
from hybridmoe.checkpoint.make import make_checkpoint
from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.errors import CheckpointError
from hybridmoe.layers.linear import MergedLinear
from hybridmoe.models.registry import load_config

TINY = {"vocab_size": 96, "hidden_size": 64, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_experts": 8,
        "num_experts_per_tok": 3, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 24, "max_position_embeddings": 512}
TINY_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 64}
MROPE = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
         "mrope_section": [2, 1, 1], "mrope_interleaved": True}
"""The releases' rope_parameters spelling, its sections cut to the 4 frequencies of 8 rotary dims."""


def tiny_qwen3_5_moe(**overrides) -> Qwen3_5MoeForCausalLM:
    """A random float32 transformers Qwen3_5MoeForCausalLM (eval mode) of the TINY shape: layers 0-2 Gated DeltaNet,
    layer 3 gated attention, every layer sparse."""
    torch.manual_seed(0)
    hf = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**{**TINY, **overrides})).float().eval()
    randomize(hf)
    return hf


CASES = {
    "three-linear-one-full-gva-2-to-1-quarter-rotary": {},
    "mrope-sections-value-heads-equal-key-heads-bias-mha": {
        "rope_parameters": MROPE, "linear_num_value_heads": 2, "num_key_value_heads": 4, "attention_bias": True},
    "alternating-kinds-kernel-2-top-1": {
        "layer_types": ["linear_attention", "full_attention"] * 2, "linear_conv_kernel_dim": 2,
        "num_experts_per_tok": 1},
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The first case's transformers model and its saved directory."""
    hf = tiny_qwen3_5_moe()
    path = tmp_path_factory.mktemp("qwen3_5_moe")
    hf.save_pretrained(path)
    return hf, path


@pytest.mark.parametrize("case", CASES)
def test_logits_and_hidden_states_equal_transformers(case, tmp_path):
    hf = tiny_qwen3_5_moe(**CASES[case])
    ours = save_and_load(hf, tmp_path, dtype="float32").model
    assert_forward_equals_transformers(ours, hf, LONG)


def test_the_layers_as_transformers_builds_them(saved):
    _, path = saved
    loaded = load_model(path, EngineConfig(dtype="float32"))
    model = loaded.model
    assert [layer.mixer_name for layer in model.model.layers] == ["linear_attn"] * 3 + ["self_attn"]
    assert model.moe_layers == [0, 1, 2, 3] and loaded.experts.layers() == [0, 1, 2, 3]
    deltanet = model.model.layers[0].linear_attn
    assert isinstance(deltanet.in_proj_qkvz, MergedLinear) and deltanet.in_proj_qkvz.out_sizes == [160, 96]
    assert deltanet.in_proj_ba.out_sizes == [4, 4]
    assert model.model.layers[3].self_attn.rotary.dim == 8
    # per sequence and DeltaNet layer: the convolution's last 3 inputs of 2*2*16 + 4*24 channels (float32 here),
    # and the float32 state of 4 value heads of 16 x 24
    assert model.state_bytes_per_seq() == 3 * (3 * 160 * 4 + 4 * 16 * 24 * 4)


def test_chunked_prefill_and_batched_decode_equal_transformers(saved):
    hf, path = saved
    ours = load_model(path, EngineConfig(dtype="float32")).model
    assert_batched_decode_equals_recomputation(ours, hf, PROMPTS, slots=[2, 0, 3])


def test_32_greedy_tokens_through_the_engine_equal_transformers_generate(saved):
    """Prefill in steps of 16 tokens (the 150-token prompt crosses the rule's chunks inside steps), then one token
    a step."""
    hf, path = saved
    llm = LLM(path, dtype="float32", max_num_batched_tokens=16)
    assert llm.engine.config.prefix_caching and not llm.engine.runner.fixed
    for prompt in (LONG, PROMPTS[1]):
        assert llm.generate(prompt, GREEDY)[0].token_ids == hf_greedy(hf, prompt)


def test_config_keys_transformers_does_not_read_are_ignored(saved, tmp_path):
    """Qwen3_5MoeTextConfig has no dense MLP and always renormalizes the top-k: a config.json naming Qwen3-Next's
    keys for those still runs every layer sparse and renormalized, as transformers does."""
    hf, path = saved
    raw = json.loads((path / "config.json").read_text())
    raw.update(intermediate_size=96, mlp_only_layers=[1], decoder_sparse_step=2, norm_topk_prob=False)
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours = load_model(tmp_path, EngineConfig(dtype="float32")).model
    assert ours.moe_layers == [0, 1, 2, 3]
    assert_forward_equals_transformers(ours, hf, LONG[:60])


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory):
    """A random transformers Qwen3_5MoeForConditionalGeneration (a one-block vision tower) saved with an mtp.*
    tensor beside its own, as the releases carry one."""
    torch.manual_seed(0)
    config = Qwen3_5MoeConfig(text_config={**TINY, "rope_parameters": MROPE}, vision_config=TINY_VISION)
    hf = Qwen3_5MoeForConditionalGeneration(config).float().eval()
    randomize(hf)
    path = tmp_path_factory.mktemp("qwen3_5_moe_vl")
    hf.save_pretrained(path)
    weights = load_file(path / "model.safetensors")
    assert any(n.startswith("model.visual.") for n in weights)
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in weights
    weights["mtp.fc.weight"] = torch.zeros(TINY["hidden_size"], 2 * TINY["hidden_size"])
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return hf, path


def test_the_text_part_of_a_multimodal_checkpoint_equals_transformers_on_text(multimodal):
    hf, path = multimodal
    loaded = load_model(path, EngineConfig(dtype="float32"))
    assert type(loaded.model).__name__ == "Qwen3_5MoeForConditionalGeneration"
    assert loaded.config.hidden_size == TINY["hidden_size"] and loaded.config.rotary_dim == 8
    ours = loaded.model
    ours.allocate_kv_cache(1, len(LONG))
    (logits,) = run_step(ours, [LONG], slots=[0], start_pos=[0])
    torch.testing.assert_close(logits, hf_forward(hf, LONG)[0], atol=1e-4, rtol=1e-4)
    assert_batched_decode_equals_recomputation(ours, hf, [LONG[:70], LONG[:9]], slots=[1, 0])


def test_a_multimodal_checkpoint_missing_a_text_tensor_names_it_in_its_layout(multimodal, tmp_path):
    _, path = multimodal
    weights = load_file(path / "model.safetensors")
    del weights["model.language_model.layers.2.linear_attn.in_proj_z.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"missing tensor model\.language_model\.layers\.2\.linear_attn\."
                                              r"in_proj_z\.weight"):
        load_model(tmp_path, EngineConfig(dtype="float32"))


def test_a_multimodal_config_without_text_config_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5MoeForConditionalGeneration"],
                                                      "model_type": "qwen3_5_moe", **TINY}))
    with pytest.raises(CheckpointError, match="text model's config as an object under text_config"):
        load_config(tmp_path)


def test_the_make_model_tiny_checkpoint_equals_transformers(tmp_path):
    make_checkpoint("qwen3_5_moe", "tiny", tmp_path, dtype="fp32", progress=False)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3_5MoeForCausalLM"
    ours = load_model(tmp_path, EngineConfig(dtype="float32")).model
    assert ours.moe_layers == [0, 1, 2, 3]
    prompt = torch.randint(0, 512, (100,), generator=torch.Generator().manual_seed(4)).tolist()
    assert_forward_equals_transformers(ours, hf, prompt)
    assert_batched_decode_equals_recomputation(ours, hf, [prompt[:70], prompt[:9]], slots=[1, 0])
