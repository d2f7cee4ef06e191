"""MiniMax-M2 equals transformers' MiniMaxM2ForCausalLM in float32: logits, hidden states, cached greedy decode.

Each case is a tiny random model of transformers' own class (weights redrawn at O(1) scale with a nonzero
e_score_correction_bias, deepseek_tiny.randomize), saved (in the released checkpoints' names: block_sparse_moe,
w1/w2/w3, the correction bias on the block) and loaded back by us; one more is make-model's tiny preset, which both
sides load from the same directory.
"""

import json

import pytest
import torch
from compare import (
    assert_batched_decode_equals_recomputation,
    assert_forward_equals_transformers,
    run_step,
    save_and_load,
)
from deepseek_tiny import randomize
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, MiniMaxM2Config, MiniMaxM2ForCausalLM

from hybridmoe.checkpoint.make import make_checkpoint
from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.errors import CheckpointError
from hybridmoe.models.registry import load_config
from hybridmoe.platform import native_engine_built

PROMPT = [5, 17, 3, 60, 22, 9, 41, 88, 0, 71, 30, 2, 64]
PROMPTS = [[5, 17, 3, 60, 22, 9, 41], [7, 2, 33], [11, 50, 8, 19, 27]]

TINY = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "num_local_experts": 8, "num_experts_per_tok": 3,
        "max_position_embeddings": 64, "rope_theta": 10000.0, "rotary_dim": 16, "bos_token_id": 1, "eos_token_id": 2}


def tiny_minimax(**overrides) -> MiniMaxM2ForCausalLM:
    """A random float32 transformers MiniMaxM2ForCausalLM (eval mode) of the TINY shape."""
    torch.manual_seed(0)
    hf = MiniMaxM2ForCausalLM(MiniMaxM2Config(**{**TINY, **overrides})).float().eval()
    randomize(hf)
    return hf


CASES = {
    # the release's proportions: half of each head rotates, GQA, 3 of 8 experts
    "half-rotary-gqa-2-to-1": {},
    "full-rotary-one-expert": {"rotary_dim": 32, "num_experts_per_tok": 1},
    "quarter-rotary-every-expert-gqa-4-to-1": {"rotary_dim": 8, "num_experts_per_tok": 8, "num_key_value_heads": 1},
    # transformers 5's spelling: the factor in rope_parameters, no rotary_dim
    "factor-in-rope-parameters-mha-four-layers": {
        "rotary_dim": None, "num_key_value_heads": 4, "num_hidden_layers": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0, "partial_rotary_factor": 0.25}},
}


@pytest.mark.parametrize("case", CASES)
def test_logits_and_hidden_states_equal_transformers(case, tmp_path):
    hf = tiny_minimax(**CASES[case])
    ours = save_and_load(hf, tmp_path, dtype="float32").model
    assert_forward_equals_transformers(ours, hf, PROMPT)


def test_the_layers_as_transformers_builds_them(tmp_path):
    """q_norm and k_norm span all heads, every layer is MoE with no shared expert, the rotary width is rotary_dim,
    and the per-head Triton kernels are not chosen (whole-q/k norms and partial rotary run as torch ops)."""
    loaded = save_and_load(tiny_minimax(rotary_dim=32), tmp_path, dtype="float32")
    model = loaded.model
    attn = model.model.layers[0].self_attn
    assert attn.q_norm.weight.shape == (4 * 32,) and attn.k_norm.weight.shape == (2 * 32,)
    assert attn.rotary.dim == 32 and not attn.fits_kernels
    assert model.moe_layers == [0, 1, 2] and loaded.experts.layers() == [0, 1, 2]
    names = {n for n, _ in model.named_parameters()}
    assert "model.layers.2.block_sparse_moe.gate.e_score_correction_bias" in names
    assert not any("shared_experts" in n or ".experts." in n or n.endswith(".bias") for n in names)


def test_routing_chooses_by_biased_scores_and_weighs_by_unbiased_ones(tmp_path):
    """Our router against transformers' MiniMaxM2TopKRouter and a float32 reference: the top-k of sigmoid + bias,
    weighted by the sigmoid scores renormalised to sum to 1."""
    hf = tiny_minimax(num_experts_per_tok=4)
    ours = save_and_load(hf, tmp_path, dtype="float32").model
    x = torch.randn(9, TINY["hidden_size"], generator=torch.Generator().manual_seed(1))
    for i, layer in enumerate(hf.model.layers):
        ids, weights = ours.model.layers[i].block_sparse_moe.gate(x)
        _, ref_weights, ref_ids = layer.mlp.gate(x, layer.mlp.e_score_correction_bias)
        scores = torch.sigmoid(x @ layer.mlp.gate.weight.T)
        chosen = torch.topk(scores + layer.mlp.e_score_correction_bias, 4, dim=-1).indices
        for got, ref in ((ids, ref_ids), (ids, chosen)):
            assert torch.equal(got.sort(dim=-1).values, ref.sort(dim=-1).values)
        by_expert = torch.zeros_like(scores).scatter(1, ids, weights)
        ref_by_expert = torch.zeros_like(scores).scatter(1, ref_ids, ref_weights)
        torch.testing.assert_close(by_expert, ref_by_expert)
        picked = scores.gather(1, ids)
        torch.testing.assert_close(weights, picked / picked.sum(dim=-1, keepdim=True))
        biased = picked + layer.mlp.e_score_correction_bias[ids]
        assert not torch.allclose(weights, biased / biased.sum(dim=-1, keepdim=True))  # the bias does not weigh


def test_correction_bias_changes_the_chosen_experts_as_in_transformers(tmp_path):
    """A large bias on two experts makes every token choose them; both sides agree."""
    hf = tiny_minimax()
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.e_score_correction_bias[[1, 6]] = 5.0
    loaded = save_and_load(hf, tmp_path, dtype="float32")
    ids, _ = loaded.model.model.layers[1].block_sparse_moe.gate(torch.randn(5, TINY["hidden_size"]))
    assert all({1, 6} <= set(row.tolist()) for row in ids)
    assert_forward_equals_transformers(loaded.model, hf, PROMPT)


def test_batched_prefill_then_greedy_decode_equals_full_recomputation(tmp_path):
    hf = tiny_minimax()
    ours = save_and_load(hf, tmp_path, dtype="float32").model
    assert_batched_decode_equals_recomputation(ours, hf, PROMPTS, slots=[2, 0, 3])


def test_32_greedy_tokens_with_the_kv_cache_equal_transformers_generate(tmp_path):
    hf = tiny_minimax(rotary_dim=8)
    ours = save_and_load(hf, tmp_path, dtype="float32").model
    prompt, new = PROMPTS[0], 32
    expected = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                           do_sample=False, max_new_tokens=new, min_new_tokens=new, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
    ours.allocate_kv_cache(1, len(prompt) + new)
    (logits,) = run_step(ours, [prompt], slots=[0], start_pos=[0])
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < new:  # one token a step, over the cache
        (logits,) = run_step(ours, [[tokens[-1]]], slots=[0], start_pos=[len(prompt) + len(tokens) - 1])
        tokens.append(int(logits[-1].argmax()))
    assert tokens == expected


def test_the_released_config_json_spelling(tmp_path):
    """MiniMax-M2's own config.json: rotary_dim and rope_theta at the top level, the keys transformers does not
    read (scoring_func, use_routing_bias, qk_norm_type, ...), the MTP modules' count."""
    raw = {"architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", **TINY, "rotary_dim": 8,
           "rope_theta": 50000, "scoring_func": "sigmoid", "use_routing_bias": True, "qk_norm_type": "per_layer",
           "use_qk_norm": True, "shared_intermediate_size": 0, "num_mtp_modules": 3, "use_mtp": True,
           "attn_type_list": [1, 1, 1]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path)).float().eval()
    randomize(hf)
    loaded = save_and_load(hf, tmp_path / "saved", dtype="float32")
    attn = loaded.model.model.layers[0].self_attn
    assert attn.rotary.dim == 8 and float(attn.rotary.inv_freq(torch.device("cpu"))[1]) == pytest.approx(50000 ** -0.25)
    assert_forward_equals_transformers(loaded.model, hf, PROMPT)


def test_a_partial_rotary_factor_wins_over_rotary_dim_as_in_transformers(tmp_path):
    raw = {"architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", **TINY, "rotary_dim": 16,
           "partial_rotary_factor": 0.25}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert AutoConfig.from_pretrained(tmp_path).rope_parameters["partial_rotary_factor"] == 0.25
    assert load_config(tmp_path)[1].rotary_dim == 8


@pytest.mark.parametrize("key, value, want", [
    ("scoring_func", "softmax", 'scoring_func must be one of "sigmoid" or null, got "softmax"'),
    ("qk_norm_type", "per_head", 'qk_norm_type must be one of "per_layer" or null, got "per_head"'),
    ("shared_intermediate_size", 64, "shared_intermediate_size must be one of 0 or null, got 64"),
    ("rotary_dim", 1, "rotary_dim must be an integer >= 2 or null, got 1"),
    ("rotary_dim", 48, "head_dim 32 with rotary_dim 48 / partial_rotary_factor 1.5 rotates 48 dimensions"),
])
def test_a_config_transformers_would_run_as_something_else_is_refused(tmp_path, key, value, want):
    raw = {"architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", **TINY, key: value}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError) as err:
        load_config(tmp_path)
    assert want in str(err.value)


def save_edited(hf: MiniMaxM2ForCausalLM, path, edit) -> None:
    """hf saved to path, its tensors (name -> tensor) changed in place by edit(weights) before they are written."""
    hf.save_pretrained(path)
    weights = load_file(path / "model.safetensors")
    edit(weights)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})


def test_the_multi_token_prediction_modules_are_skipped(tmp_path):
    """Released checkpoints carry layers num_hidden_layers.. (the MTP modules); loading ignores them."""
    hf, n, hidden = tiny_minimax(), TINY["num_hidden_layers"], TINY["hidden_size"]
    save_edited(hf, tmp_path, lambda w: w.update({
        f"model.layers.{n}.self_attn.q_proj.weight": torch.zeros(4 * 32, hidden),
        f"model.layers.{n + 2}.block_sparse_moe.experts.0.w1.weight": torch.zeros(32, hidden)}))
    ours = load_model(tmp_path, EngineConfig(dtype="float32")).model
    assert_forward_equals_transformers(ours, hf, PROMPT)


def test_a_checkpoint_without_the_correction_bias_names_it_as_the_release_spells_it(tmp_path):
    save_edited(tiny_minimax(), tmp_path, lambda w: w.pop("model.layers.1.block_sparse_moe.e_score_correction_bias"))
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.block_sparse_moe\."
                                              r"e_score_correction_bias"):
        load_model(tmp_path, EngineConfig(dtype="float32"))


def test_the_make_model_tiny_checkpoint_equals_transformers(tmp_path):
    """make-model's minimax_m2 tiny (the release's config.json spelling) in both."""
    make_checkpoint("minimax_m2", "tiny", tmp_path, dtype="fp32", progress=False)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = load_model(tmp_path, EngineConfig(dtype="float32")).model
    attn = ours.model.layers[0].self_attn
    assert attn.rotary.dim == attn.head_dim // 2 and attn.q_norm.weight.shape == (attn.num_heads * attn.head_dim,)
    assert ours.moe_layers == [0, 1, 2]
    assert_forward_equals_transformers(ours, hf, PROMPT)
    assert_batched_decode_equals_recomputation(ours, hf, PROMPTS, slots=[1, 0, 2])


@pytest.mark.skipif(not native_engine_built(), reason="the native expert engine is not built")
def test_the_native_cpu_experts_give_the_torch_experts_logits(tmp_path):
    """The routed experts (w1/w3/w2 in the checkpoint) handed to the C++ engine, which computes in bf16: the bf16
    row of the models' tolerance table."""
    make_checkpoint("minimax_m2", "tiny", tmp_path, dtype="fp32", progress=False)
    logits = []
    for options in ({"expert_backend": "torch"},
                    {"expert_backend": "native", "expert_format": "bf16", "cpu_threads": 1}):
        model = load_model(tmp_path, EngineConfig(dtype="float32", **options)).model
        model.allocate_kv_cache(1, len(PROMPT))
        logits.append(run_step(model, [PROMPT], slots=[0], start_pos=[0])[0])
    torch.testing.assert_close(logits[1], logits[0], atol=5e-2, rtol=5e-2)
