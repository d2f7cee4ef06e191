"""Qwen3-Next equals transformers' Qwen3NextForCausalLM in float32: logits and hidden states over prompts longer than
the delta rule's chunk, greedy tokens through the engine (chunked prefill, batches, preemption), make-model's tiny.

Each case is a tiny random model of transformers' own class with both layer kinds (Gated DeltaNet and gated
attention), its weights redrawn at O(1) scale (randomize), saved and loaded back by us.
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
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM

from hybridmoe import LLM, SamplingParams
from hybridmoe.checkpoint.make import make_checkpoint
from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.errors import CheckpointError, HybridMoEError
from hybridmoe.forward_context import single_sequence_context, use_context
from hybridmoe.models.registry import load_config

TINY = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 3,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 24,
        "max_position_embeddings": 512, "mlp_only_layers": [1]}
LONG = torch.randint(0, 96, (150,), generator=torch.Generator().manual_seed(3)).tolist()
"""Past two chunks of 64 of the delta rule, not a multiple of it."""
PROMPTS = [LONG[:70], LONG[100:105], LONG[:130]]
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Weights at O(1) scale (transformers' 0.02 init leaves every layer near the identity): linears by 1/sqrt(in),
    the (1 + weight) norms around 0 and the DeltaNet output norm around 1, decays spread over (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    for name, t in model.named_parameters():
        if name.endswith("linear_attn.norm.weight"):
            t.copy_(1 + 0.2 * torch.randn(t.shape, generator=gen))
        elif name.endswith("norm.weight"):
            t.copy_(0.2 * torch.randn(t.shape, generator=gen))
        elif name.endswith("A_log"):
            t.copy_(torch.empty(t.shape).uniform_(-1.0, 1.5, generator=gen))
        elif name.endswith("dt_bias"):
            t.copy_(0.5 * torch.randn(t.shape, generator=gen))
        elif t.dim() >= 2:
            t.copy_(torch.randn(t.shape, generator=gen) * t.shape[-1] ** -0.5)


def tiny_qwen3_next(**overrides) -> Qwen3NextForCausalLM:
    """A random float32 transformers Qwen3NextForCausalLM (eval mode) of the TINY shape: layers 0-2 Gated DeltaNet,
    layer 3 gated attention, layer 1 a dense MLP."""
    torch.manual_seed(0)
    hf = Qwen3NextForCausalLM(Qwen3NextConfig(**{**TINY, **overrides})).float().eval()
    randomize(hf)
    return hf


CASES = {
    "three-linear-one-full-gva-2-to-1-quarter-rotary": {},
    "value-heads-equal-key-heads-whole-rotary-bias-mha": {
        "linear_num_value_heads": 2, "num_key_value_heads": 4, "attention_bias": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0, "partial_rotary_factor": 1.0}},
    "alternating-kinds-kernel-2-unnormalized-sparse-step-2": {
        "layer_types": ["linear_attention", "full_attention"] * 2, "linear_conv_kernel_dim": 2,
        "norm_topk_prob": False, "decoder_sparse_step": 2, "mlp_only_layers": []},
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The first case's transformers model and its saved directory."""
    hf = tiny_qwen3_next()
    path = tmp_path_factory.mktemp("qwen3_next")
    hf.save_pretrained(path)
    return hf, path


@pytest.mark.parametrize("case", CASES)
def test_logits_and_hidden_states_equal_transformers(case, tmp_path):
    hf = tiny_qwen3_next(**CASES[case])
    ours = save_and_load(hf, tmp_path, dtype="float32").model
    assert_forward_equals_transformers(ours, hf, LONG)


def test_the_layers_as_transformers_builds_them(saved):
    _, path = saved
    loaded = load_model(path, EngineConfig(dtype="float32"))
    model = loaded.model
    assert [layer.mixer_name for layer in model.model.layers] == ["linear_attn"] * 3 + ["self_attn"]
    assert model.moe_layers == [0, 2, 3] and loaded.experts.layers() == [0, 2, 3]
    attn = model.model.layers[3].self_attn
    assert attn.rotary.dim == 8 and not attn.fits_kernels
    names = {n for n, _ in model.named_parameters()}
    assert {"model.layers.0.linear_attn.in_proj_qkvz.weight", "model.layers.0.linear_attn.conv1d.weight",
            "model.layers.0.linear_attn.A_log", "model.layers.0.mlp.shared_expert_gate.weight",
            "model.layers.1.mlp.gate_up_proj.weight", "model.layers.3.self_attn.q_norm.weight"} <= names
    # per sequence and DeltaNet layer: the convolution's last 3 inputs of 2*2*16 + 4*24 channels (float32 here),
    # and the float32 state of 4 value heads of 16 x 24
    assert model.state_bytes_per_seq() == 3 * (3 * 160 * 4 + 4 * 16 * 24 * 4)
    assert model.kv_bytes_per_token() == 2 * 2 * 32 * 4  # the one attention layer's keys and values


def test_chunked_prefill_and_batched_decode_equal_transformers(saved):
    """Prompts prefilled together from position 0 into slots 2, 0, 3 (their states side by side), then three decode
    steps as one batch: every step's logits equal transformers' full recomputation."""
    hf, path = saved
    ours = load_model(path, EngineConfig(dtype="float32")).model
    assert_batched_decode_equals_recomputation(ours, hf, PROMPTS, slots=[2, 0, 3])


def test_a_prompt_in_uneven_chunks_equals_it_whole(saved):
    """Steps of 50, 64 and 36 tokens (across the rule's chunks at other offsets each time) continue one another."""
    hf, path = saved
    ours = load_model(path, EngineConfig(dtype="float32")).model
    ours.allocate_kv_cache(1, len(LONG))
    start, logits = 0, []
    for n in (50, 64, 36):
        logits += run_step(ours, [LONG[start:start + n]], slots=[0], start_pos=[start])
        start += n
    torch.testing.assert_close(torch.cat(logits), hf_forward(hf, LONG)[0], atol=1e-4, rtol=1e-4)


def test_a_step_that_does_not_continue_its_slot_is_refused(saved):
    _, path = saved
    ours = load_model(path, EngineConfig(dtype="float32")).model
    ours.allocate_kv_cache(2, 32)
    run_step(ours, [LONG[:5]], slots=[1], start_pos=[0])
    with pytest.raises(RuntimeError, match="slot 1's recurrent state holds 5 positions and the step starts at 9"):
        run_step(ours, [LONG[9:12]], slots=[1], start_pos=[9])


def test_a_reused_slot_starts_from_zeros_at_position_0(saved):
    """Slots 0 and 1 hold 40 and 12 positions; then a one-token prompt takes slot 0 beside slot 1's next token, a
    step of one token per sequence (the batched recurrent path), and a 7-token prompt takes slot 1: each equals
    transformers on that prompt alone."""
    hf, path = saved
    ours = load_model(path, EngineConfig(dtype="float32")).model
    ours.allocate_kv_cache(2, 64)
    run_step(ours, [LONG[:40], LONG[50:62]], slots=[0, 1], start_pos=[0, 0])
    fresh, going = run_step(ours, [LONG[90:91], LONG[62:63]], slots=[0, 1], start_pos=[0, 12])
    torch.testing.assert_close(fresh[-1], hf_forward(hf, LONG[90:91])[0][-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(going[-1], hf_forward(hf, LONG[50:63])[0][-1], atol=1e-4, rtol=1e-4)
    (again,) = run_step(ours, [LONG[:7]], slots=[1], start_pos=[0])
    torch.testing.assert_close(again, hf_forward(hf, LONG[:7])[0], atol=1e-4, rtol=1e-4)


def hf_greedy(hf, prompt: list[int], new: int = 32) -> list[int]:
    return hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                       do_sample=False, max_new_tokens=new, min_new_tokens=new, eos_token_id=None,
                       pad_token_id=0)[0, len(prompt):].tolist()


def test_32_greedy_tokens_through_the_engine_equal_transformers_generate(saved):
    """Prefill in steps of 16 tokens (the 150-token prompt crosses the rule's chunks inside steps), then one token
    a step."""
    hf, path = saved
    llm = LLM(path, dtype="float32", max_num_batched_tokens=16)
    assert llm.engine.config.prefix_caching and not llm.engine.runner.fixed
    for prompt in (LONG, PROMPTS[1]):
        assert llm.generate(prompt, GREEDY)[0].token_ids == hf_greedy(hf, prompt)
    # the same prompt again: its two full blocks of 64 and the state snapshot at their end come from the cache
    again = llm.generate(LONG, GREEDY)[0]
    assert again.token_ids == hf_greedy(hf, LONG) and again.num_cached_tokens == 128


def test_sequences_batched_together_give_each_its_own_tokens(saved):
    """Three prompts of different lengths in one engine (prefill chunks beside decoding rows, every step) give the
    tokens each gives alone: no state crosses slots."""
    _, path = saved
    alone = LLM(path, dtype="float32")
    expected = [alone.generate(p, GREEDY)[0].token_ids for p in PROMPTS]
    batched = LLM(path, dtype="float32", max_num_seqs=3, max_num_batched_tokens=24)
    assert [o.token_ids for o in batched.generate(PROMPTS, [GREEDY] * 3)] == expected


def test_a_preempted_sequence_resumes_with_the_tokens_it_would_have_had(saved):
    _, path = saved
    alone = LLM(path, dtype="float32", kv_block_size=16)
    prompts, params = [LONG[:100], LONG[10:100]], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    expected = [alone.generate(p, params)[0].token_ids for p in prompts]
    plan = alone.engine.kv_plan
    # 17 blocks of 16 hold one sequence of 160 tokens, not two (beside the states of both and two prefix snapshots
    # of each): the later one is preempted
    budget = 17 * 16 * plan.bytes_per_token + (2 + 4) * plan.state_bytes // alone.engine.config.max_num_seqs
    tight = LLM(path, dtype="float32", kv_block_size=16, max_num_seqs=2, kv_cache_budget=budget, max_model_len=256)
    assert tight.engine.kv_plan.tokens == 17 * 16 and tight.engine.kv_plan.snapshots == 4  # states paid for first
    assert [o.token_ids for o in tight.generate(prompts, [params, params])] == expected
    assert tight.engine.scheduler.num_preemptions > 0


def test_the_kv_plan_counts_the_states(saved):
    _, path = saved
    llm = LLM(path, dtype="float32", max_num_seqs=3, kv_block_size=16)
    per_seq = llm.engine.runner.model.state_bytes_per_seq()
    plan = llm.engine.kv_plan
    assert plan.state_bytes == 3 * per_seq
    assert plan.snapshots == 2 * 3 and plan.snapshot_bytes == 6 * per_seq  # prefix caching's state snapshots
    assert plan.bytes == plan.num_blocks * 16 * plan.bytes_per_token + (3 + 6) * per_seq
    with pytest.raises(HybridMoEError, match="holds no block of 16 tokens .* beside .* of recurrent states"):
        LLM(path, dtype="float32", max_num_seqs=3, kv_block_size=16, kv_cache_budget=3 * per_seq)


def test_the_released_config_json_spelling(tmp_path):
    """Qwen3-Next-80B-A3B's own config.json: rope_theta and partial_rotary_factor at the top level,
    full_attention_interval without layer_types, use_sliding_window (which transformers does not read)."""
    raw = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", **TINY, "rope_theta": 50000.0,
           "partial_rotary_factor": 0.5, "full_attention_interval": 2, "rope_scaling": None,
           "use_sliding_window": False}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path)).float().eval()
    randomize(hf)
    assert hf.config.layer_types == ["linear_attention", "full_attention"] * 2
    hf.save_pretrained(tmp_path / "saved")
    (tmp_path / "saved" / "config.json").write_text(json.dumps(raw))  # ours reads the release's spelling
    ours = load_model(tmp_path / "saved", EngineConfig(dtype="float32")).model
    attn = ours.model.layers[1].self_attn
    assert attn.rotary.dim == 16 and float(attn.rotary.inv_freq(torch.device("cpu"))[1]) == pytest.approx(50000 ** -0.125)
    assert_forward_equals_transformers(ours, hf, LONG)


@pytest.mark.parametrize("changes, want", [
    ({"layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]},
     "layer_types must be a list of 4 (num_hidden_layers) entries linear_attention or full_attention"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads 3 must be a multiple of linear_num_key_heads 2"),
    ({"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim must be an integer >= 1, got 0"),
])
def test_a_config_we_would_misread_is_refused(tmp_path, changes, want):
    raw = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", **TINY, **changes}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError) as err:
        load_config(tmp_path)
    assert want in str(err.value)


def test_the_multi_token_prediction_module_is_skipped(tmp_path):
    """Released checkpoints carry mtp.* (the MTP module); loading ignores it."""
    hf = tiny_qwen3_next()
    hf.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["mtp.fc.weight"] = torch.zeros(TINY["hidden_size"], 2 * TINY["hidden_size"])
    weights["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = torch.zeros(32, TINY["hidden_size"])
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ours = load_model(tmp_path, EngineConfig(dtype="float32")).model
    assert_forward_equals_transformers(ours, hf, LONG[:40])


def test_the_make_model_tiny_checkpoint_equals_transformers(tmp_path):
    make_checkpoint("qwen3_next", "tiny", tmp_path, dtype="fp32", progress=False)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = load_model(tmp_path, EngineConfig(dtype="float32")).model
    assert ours.moe_layers == [0, 2, 3]
    prompt = torch.randint(0, 512, (100,), generator=torch.Generator().manual_seed(4)).tolist()
    assert_forward_equals_transformers(ours, hf, prompt)
    assert_batched_decode_equals_recomputation(ours, hf, [prompt[:70], prompt[:9]], slots=[1, 0])


def test_without_a_state_only_a_whole_prompt_runs(saved):
    _, path = saved
    model = load_model(path, EngineConfig(dtype="float32")).model
    layer = model.model.layers[0].linear_attn
    x = torch.randn(4, TINY["hidden_size"])
    with use_context(single_sequence_context(4, start_pos=3)), pytest.raises(RuntimeError, match="allocate_state"):
        layer(x, torch.arange(3, 7))
