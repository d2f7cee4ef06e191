"""Every family's tiny checkpoint loads in Hugging Face transformers as-is: no missing or unexpected
weights, the values we wrote are the values it uses, a forward pass runs, the tokenizer and its
chat template work, and config.json's token ids agree with the tokenizer."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridmoe.checkpoint import ARCHS, make_checkpoint
from hybridmoe.checkpoint.make import TIKTOKEN_ARCHS

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "Tell me a joke."},
]

# arch -> (end-of-turn token, text the rendered prompt must end with)
TEMPLATE_ENDS = {
    "qwen2_moe": ("<|im_end|>", "<|im_start|>assistant\n"),
    "qwen3_moe": ("<|im_end|>", "<|im_start|>assistant\n"),
    "deepseek_v2": ("<｜end▁of▁sentence｜>", "<｜User｜>Tell me a joke.<｜Assistant｜>"),
    "deepseek_v3": ("<｜end▁of▁sentence｜>", "<｜User｜>Tell me a joke.<｜Assistant｜>"),
    "deepseek_v32": ("<｜end▁of▁sentence｜>", "<｜User｜>Tell me a joke.<｜Assistant｜>"),
    "mixtral": ("</s>", "[INST] Tell me a joke. [/INST]"),
    "glm4_moe": ("<|user|>", "<|user|>\nTell me a joke.<|assistant|>"),
    "minimax_m2": ("[e~[", "]~b]user\nTell me a joke.[e~[\n]~b]ai\n<think>\n"),
    "gpt_oss": ("<|return|>", "<|start|>user<|message|>Tell me a joke.<|end|><|start|>assistant"),
    "qwen3_next": ("<|im_end|>", "<|im_start|>assistant\n"),
    "qwen3_5_moe": ("<|im_end|>", "<|im_start|>assistant\n"),
}
TURN_CLOSES = {"gpt_oss": "<|end|>"}
"""arch -> what closes an earlier answer where that is not the end-of-turn token (harmony's <|return|> ends only
the answer being generated)."""


# kimi_k2: transformers has neither its model_type nor a tiktoken tokenizer; test_make_model_kimi.py loads its
# weights in DeepseekV3ForCausalLM and holds its tokenizer against tiktoken
@pytest.fixture(scope="module", params=[a for a in ARCHS if a not in TIKTOKEN_ARCHS])
def tiny(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / "ckpt"
    summary = make_checkpoint(request.param, "tiny", out, dtype="fp32", seed=1, progress=False)
    return request.param, out, summary


def _file_tensor(out, name):
    shard = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"][name]
    with safe_open(out / shard, "pt") as f:
        return f.get_tensor(name)


def test_transformers_loads_every_weight_and_runs(tiny):
    arch, out, summary = tiny
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(model).__name__ == ARCHS[arch]
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids = torch.randint(0, summary.config["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits  # [batch 2, seq 7, vocab]
    assert logits.shape == (2, 7, summary.config["vocab_size"])
    assert torch.isfinite(logits).all() and logits.std() > 0.1


def test_transformers_uses_the_values_we_wrote(tiny):
    arch, out, summary = tiny
    model = AutoModelForCausalLM.from_pretrained(out)
    state = model.state_dict()
    layer = summary.config["num_hidden_layers"] - 1  # an MoE layer in every tiny preset
    prefix = f"model.layers.{layer}"
    if arch == "gpt_oss":  # the file holds the experts fused as transformers does: the same tensors
        parts = ("experts.gate_up_proj", "experts.gate_up_proj_bias", "experts.down_proj", "experts.down_proj_bias",
                 "router.weight", "router.bias")
        for name in [*(f"{prefix}.mlp.{p}" for p in parts), f"{prefix}.self_attn.sinks", "lm_head.weight"]:
            torch.testing.assert_close(state[name], _file_tensor(out, name))
        return
    mixtral_names = arch in ("mixtral", "minimax_m2")
    moe = f"{prefix}.block_sparse_moe" if mixtral_names else f"{prefix}.mlp"
    gate, up, down = ("w1", "w3", "w2") if mixtral_names else ("gate_proj", "up_proj", "down_proj")
    # transformers stacks per-expert weights: gate_up_proj [E, 2I, H] = cat(gate, up), down_proj [E, H, I]
    expected_gate_up = torch.cat([_file_tensor(out, f"{moe}.experts.1.{gate}.weight"),
                                  _file_tensor(out, f"{moe}.experts.1.{up}.weight")])
    torch.testing.assert_close(state[f"{prefix}.mlp.experts.gate_up_proj"][1], expected_gate_up)
    torch.testing.assert_close(state[f"{prefix}.mlp.experts.down_proj"][1],
                               _file_tensor(out, f"{moe}.experts.1.{down}.weight"))
    for name in ["model.embed_tokens.weight", f"{prefix}.post_attention_layernorm.weight", "lm_head.weight"]:
        torch.testing.assert_close(state[name], _file_tensor(out, name))
    if arch in ("deepseek_v3", "glm4_moe"):
        bias = f"{prefix}.mlp.gate.e_score_correction_bias"
        torch.testing.assert_close(state[bias], _file_tensor(out, bias))
    if arch == "minimax_m2":  # the bias on the block, in the file and in transformers' module
        torch.testing.assert_close(state[f"{prefix}.mlp.e_score_correction_bias"],
                                   _file_tensor(out, f"{moe}.e_score_correction_bias"))
        torch.testing.assert_close(state[f"{prefix}.self_attn.q_norm.weight"],
                                   _file_tensor(out, f"{prefix}.self_attn.q_norm.weight"))


def test_tokenizer_and_chat_template(tiny):
    arch, out, summary = tiny
    tok = AutoTokenizer.from_pretrained(out)
    end_of_turn, prompt_end = TEMPLATE_ENDS[arch]
    closes = TURN_CLOSES.get(arch, end_of_turn)
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text.endswith(prompt_end)
    assert "You are a helpful assistant." in text and "Paris." + closes in text
    assert summary.config["eos_token_id"] == tok.convert_tokens_to_ids(end_of_turn) == tok.eos_token_id
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert max(ids) < summary.config["vocab_size"] and len(tok) <= summary.config["vocab_size"]
    assert closes in tok.convert_ids_to_tokens(ids)  # special tokens stay single tokens
    words = tok.tokenize(" the capital of France")
    assert len(words) == 4  # trained merges give word-sized pieces
    assert tok.decode(tok("Hello, world!", add_special_tokens=False)["input_ids"]) == "Hello, world!"
