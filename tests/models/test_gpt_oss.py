"""gpt-oss equals transformers' GptOssForCausalLM in float32: logits, hidden states, greedy tokens with the KV cache.

Each case is a tiny random model of transformers' own class, its weights redrawn at O(1) scale with every bias and
the attention sinks nonzero (transformers starts the biases at zero and the sinks near it), a window of 8
positions and prompts up to 40 tokens, so the window hides keys. One more is make-model's tiny preset, which both
sides load from the same directory. The native CPU engine runs the experts too (bf16 and int8: logits within the
bf16 tolerance, greedy tokens in bf16; the hybrid split: tests/hybrid/test_gpt_oss_split.py); what cannot run them
(convert) refuses in one line, and "auto" takes the native engine on the CPU, the torch reference on a GPU (never the
hybrid split); a missing or misshapen fused expert tensor fails naming it; the harmony chat template. MXFP4
checkpoints: tests/formats/test_mxfp4.py.
"""

import re

import pytest
import torch
from compare import (
    assert_batched_decode_equals_recomputation,
    assert_close,
    assert_forward_equals_transformers,
    hf_forward,
    run_step,
    save_and_load,
)
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GptOssConfig, GptOssForCausalLM

from hybridmoe import LLM, SamplingParams
from hybridmoe.checkpoint.make import make_checkpoint
from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.errors import CheckpointError, HybridMoEError
from hybridmoe.layers.clamped_swiglu import ClampedSwiGLU
from hybridmoe.server.tool_parsers import parser_for_template
from hybridmoe.system.auto import resolve_expert_backend
from hybridmoe.tokenizer import Tokenizer
from hybridmoe.weights.convert import convert_checkpoint

PROMPT = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(7)).tolist()
PROMPTS = [PROMPT[:13], PROMPT[5:25], PROMPT[30:39]]
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)

TINY = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 8,
        "num_experts_per_tok": 3, "sliding_window": 8, "max_position_embeddings": 131072, "swiglu_limit": 0.8}
"""swiglu_limit 0.8: the clamps bind on O(1) activations (the released 7.0 is a case of its own)."""


def randomize(hf: GptOssForCausalLM) -> None:
    """Every weight at O(1) scale: linear and fused expert weights normal with std 1/sqrt(their input dim), norms
    near 1, every bias normal std 0.5, sinks and embeddings normal std 1."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                std, mean = 0.1, 1.0
            elif "bias" in name:
                std, mean = 0.5, 0.0
            elif name.endswith(("sinks", "embed_tokens.weight")):
                std, mean = 1.0, 0.0
            else:  # [out, in] linears, [E, in, out] fused experts
                std, mean = p.shape[-1 if p.dim() == 2 else 1] ** -0.5, 0.0
            p.copy_(torch.randn(p.shape, generator=g) * std + mean)


def tiny_gpt_oss(**overrides) -> GptOssForCausalLM:
    """A random float32 transformers GptOssForCausalLM (eval mode) of the TINY shape."""
    torch.manual_seed(0)
    hf = GptOssForCausalLM(GptOssConfig(**{**TINY, **overrides})).float().eval()
    randomize(hf)
    return hf


def yarn(**overrides) -> dict:
    return {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 4096, **overrides}


CASES = {
    # the release's layout: even layers slide, odd ones see everything, released YaRN, q/k/v/o biases
    "alternating-window-clamped": {},
    "released-swiglu-limit-gqa-4-to-1": {"swiglu_limit": 7.0, "num_key_value_heads": 1},
    "all-sliding-truncated-yarn-top-1": {"layer_types": ["sliding_attention"] * 3, "num_experts_per_tok": 1,
                                         "rope_parameters": yarn(truncate=True, factor=8.0, rope_theta=10000.0,
                                                                 original_max_position_embeddings=16)},
    "full-attention-no-bias-tied": {"layer_types": ["full_attention"] * 3, "attention_bias": False,
                                    "tie_word_embeddings": True, "num_key_value_heads": 4},
}


@pytest.mark.parametrize("case", CASES)
def test_logits_and_hidden_states_equal_transformers(case, tmp_path):
    hf = tiny_gpt_oss(**CASES[case])
    loaded = save_and_load(hf, tmp_path, dtype="float32")
    assert type(loaded.experts).__name__ == "TorchExperts"
    assert_forward_equals_transformers(loaded.model, hf, PROMPT)


def test_the_layers_follow_layer_types_and_hold_sinks_and_biases(tmp_path):
    ours = save_and_load(tiny_gpt_oss(), tmp_path, dtype="float32").model
    assert [layer.self_attn.sliding_window for layer in ours.model.layers] == [8, None, 8]
    attn = ours.model.layers[0].self_attn
    assert attn.sinks.shape == (4,) and attn.o_proj.bias is not None and attn.qkv_proj.bias is not None
    assert attn.fits_kernels  # a decode step's Triton kernels take the sinks
    assert not any(".experts." in n for n, _ in ours.named_parameters())


def test_experts_equal_transformers_experts_where_the_clamps_bind(tmp_path):
    """A layer's experts as the loader splits transformers' fused gate_up_proj (gate and up interleaved by column)
    equal GptOssExperts, on inputs large enough that gate passes the limit and up passes it on both sides."""
    hf = tiny_gpt_oss(swiglu_limit=7.0)
    experts = save_and_load(hf, tmp_path, dtype="float32").experts
    g = torch.Generator().manual_seed(3)
    x = 8 * torch.randn(23, TINY["hidden_size"], generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(23)])
    weights = torch.softmax(torch.randn(23, 3, generator=g), dim=-1)
    theirs = hf.model.layers[1].mlp.experts
    gate_up = torch.einsum("th,ehi->tei", x, theirs.gate_up_proj) + theirs.gate_up_proj_bias
    assert (gate_up[..., ::2] > 7).any() and (gate_up[..., 1::2] > 7).any() and (gate_up[..., 1::2] < -7).any()
    with torch.no_grad():
        assert_close(experts.forward(1, x, ids, weights), theirs(x, ids, weights), what="experts")


def test_chunked_prefill_across_the_window_equals_transformers(tmp_path):
    """The prompt in chunks of 5, 6, 13 and 16 tokens (boundaries before, at and past the window of 8), each chunk
    over the keys cached by the ones before it: every position's logits equal transformers' one pass."""
    hf = tiny_gpt_oss()
    ours = save_and_load(hf, tmp_path, dtype="float32").model
    ours.allocate_kv_cache(1, len(PROMPT))
    ref_logits, _ = hf_forward(hf, PROMPT)
    start = 0
    for n in (5, 6, 13, 16):
        (logits,) = run_step(ours, [PROMPT[start:start + n]], slots=[0], start_pos=[start])
        assert_close(logits, ref_logits[start:start + n], what=f"chunk at {start}")
        start += n


def test_batched_prefill_then_greedy_decode_equals_full_recomputation(tmp_path):
    hf = tiny_gpt_oss()
    ours = save_and_load(hf, tmp_path, dtype="float32").model
    assert_batched_decode_equals_recomputation(ours, hf, PROMPTS, slots=[2, 0, 1], steps=6)


@pytest.mark.parametrize("max_num_batched_tokens", [2048, 7], ids=["whole-prompt", "chunks-of-7"])
def test_greedy_32_tokens_through_the_engine_equal_transformers_generate(max_num_batched_tokens, tmp_path):
    hf = tiny_gpt_oss()
    hf.save_pretrained(tmp_path)
    hf.generation_config.eos_token_id = None  # all 32 tokens, like ignore_eos
    with torch.no_grad():
        expected = hf.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                               do_sample=False, max_new_tokens=32, min_new_tokens=32)[0, len(PROMPT):]
    llm = LLM(tmp_path, dtype="float32", max_num_seqs=1, max_num_batched_tokens=max_num_batched_tokens)
    assert llm.generate(PROMPT, GREEDY)[0].token_ids == expected.tolist()


def test_the_make_model_tiny_checkpoint_equals_transformers(tmp_path):
    """make-model's gpt_oss tiny (the release's config.json spelling: rope_scaling, YaRN, window 8) in both."""
    make_checkpoint("gpt_oss", "tiny", tmp_path, dtype="fp32", progress=False)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = load_model(tmp_path, EngineConfig(dtype="float32")).model
    assert [layer.self_attn.sliding_window for layer in ours.model.layers] == [8, None, 8]
    assert_forward_equals_transformers(ours, hf, PROMPT)
    assert_batched_decode_equals_recomputation(ours, hf, PROMPTS, slots=[1, 0, 2])


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_native_experts_give_transformers_logits(fmt, tmp_path):
    """The native engine's experts (biases, clamps binding at limit 0.8) under the float32 model: a prefill of 40
    tokens, then a decode step of two sequences, within the bf16 row of the tolerance table. The packed-expert cache
    holds no biases: nothing is written there (int8 would be cached otherwise)."""
    hf = tiny_gpt_oss()
    loaded = save_and_load(hf, tmp_path / "model", dtype="float32", expert_backend="native", expert_format=fmt,
                           cpu_threads=2, cache_dir=str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()
    layer = loaded.experts.layer_experts(1)
    assert type(loaded.experts).__name__ == "NativeLayers" and layer.format == fmt
    assert layer.glu == ClampedSwiGLU(alpha=1.702, limit=0.8) and layer.has_biases
    ours = loaded.model
    ours.allocate_kv_cache(2, len(PROMPT) + 1)
    prompts = [PROMPT, PROMPT[:17]]
    got = run_step(ours, prompts, slots=[0, 1], start_pos=[0, 0])
    for g, p in zip(got, prompts):
        assert_close(g, hf_forward(hf, p)[0], dtype=torch.bfloat16, what=f"native {fmt} prefill")
    nxt = [int(g[-1].argmax()) for g in got]
    decode = run_step(ours, [[n] for n in nxt], slots=[0, 1], start_pos=[len(p) for p in prompts])
    for d, p, n in zip(decode, prompts, nxt):
        assert_close(d[0], hf_forward(hf, p + [n])[0][-1], dtype=torch.bfloat16, what=f"native {fmt} decode")


def test_native_bf16_greedy_tokens_equal_transformers_generate(tmp_path):
    hf = tiny_gpt_oss()
    hf.save_pretrained(tmp_path)
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        expected = hf.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                               do_sample=False, max_new_tokens=32, min_new_tokens=32)[0, len(PROMPT):]
    llm = LLM(tmp_path, dtype="float32", expert_backend="native", expert_format="bf16", cpu_threads=2,
              max_num_seqs=1)
    assert llm.generate(PROMPT, GREEDY)[0].token_ids == expected.tolist()


def test_auto_takes_the_native_experts_on_the_cpu(tmp_path):
    make_checkpoint("gpt_oss", "tiny", tmp_path, dtype="bf16", progress=False)
    loaded = load_model(tmp_path, EngineConfig(dtype="bfloat16"))
    assert loaded.engine_config.expert_backend == "native" and loaded.engine_config.gpu_memory_budget is None
    assert loaded.experts.layer_experts(0).glu is not None


def test_on_a_gpu_auto_takes_the_native_engine_for_the_hybrid_split(tmp_path):
    """The choice a CUDA device would get, made without one (the call reads no device): the native engine, whose
    experts the hybrid split shares with the GPU (biases and clamped SwiGLU on both sides)."""
    make_checkpoint("gpt_oss", "tiny", tmp_path, dtype="bf16", progress=False)
    config = load_model(tmp_path, EngineConfig(dtype="bfloat16", expert_backend="torch")).config
    assert resolve_expert_backend(EngineConfig(device="cuda"), config, torch.bfloat16, tmp_path) == "native"


@pytest.mark.parametrize("change, says", [
    ("drop", "checkpoint is missing tensor model.layers.1.mlp.experts.down_proj_bias"),
    ("reshape", r"tensor model.layers.1.mlp.experts.down_proj_bias has shape \[8, 32\], expected \[8, 64\]"),
])
def test_a_fused_expert_tensor_missing_or_misshapen_is_named(change, says, tmp_path):
    tiny_gpt_oss().save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj_bias"
    if change == "drop":
        del weights[name]
    else:
        weights[name] = torch.zeros(8, 32)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=says):
        load_model(tmp_path, EngineConfig(dtype="float32"))


def test_convert_for_the_native_engine_refuses_in_one_line(tmp_path):
    make_checkpoint("gpt_oss", "tiny", tmp_path / "src", dtype="bf16", progress=False)
    with pytest.raises(HybridMoEError, match="a converted directory holds no routed experts with the clamped SwiGLU"):
        convert_checkpoint(tmp_path / "src", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_the_harmony_template_renders_turns_and_calls_as_transformers_does(tmp_path):
    """make-model's chat template, rendered by our tokenizer and by transformers' (the same text but for today's
    date, which each fills in): harmony's turns, channels and an earlier call; the server reads its output as
    harmony (analysis as reasoning, calls to functions.NAME)."""
    make_checkpoint("gpt_oss", "tiny", tmp_path, dtype="fp32", progress=False)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Rome?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
                {"role": "tool", "content": "sunny"}]
    ours = Tokenizer.from_dir(tmp_path).apply_chat_template(messages, add_generation_prompt=True)
    theirs = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(messages, tokenize=False,
                                                                         add_generation_prompt=True)
    undated = re.compile(r"Current date: \d{4}-\d\d-\d\d\n")
    assert undated.sub("", ours) == undated.sub("", theirs)
    assert undated.sub("", ours) == (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        "Knowledge cutoff: 2024-06\n\nReasoning: medium\n\n# Valid channels: analysis, commentary, final. "
        "Channel must be included for every message.<|end|>"
        "<|start|>developer<|message|># Instructions\n\nBe brief.<|end|>"
        "<|start|>user<|message|>Weather in Rome?<|end|>"
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Rome"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
        "<|start|>assistant")
    assert parser_for_template(Tokenizer.from_dir(tmp_path).chat_template).name == "harmony"
