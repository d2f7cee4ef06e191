"""make-model's kimi_k2 checkpoints: Kimi-K2's files (tiktoken.model and tokenizer_config.json, no tokenizer.json;
config.json model_type kimi_k2 on DeepseekV3ForCausalLM), a tokenizer that is tiktoken's with Kimi's regex and
special ids, a chat template in Kimi's format, and a model that generates through our engine what transformers'
DeepseekV3ForCausalLM generates with the same weights."""

import json
import re
import shutil

import pytest
import tiktoken
import torch
from tiktoken.load import load_tiktoken_bpe
from transformers import DeepseekV3ForCausalLM

from hybridmoe import LLM, SamplingParams
from hybridmoe.checkpoint import make_checkpoint, model_config
from hybridmoe.checkpoint.tensors import tensor_specs
from hybridmoe.cli import main
from hybridmoe.sampling_params import StructuredOutput
from hybridmoe.server.tool_parsers import parser_for_template
from hybridmoe.tokenizer import Tokenizer
from hybridmoe.tokenizer_tiktoken import KIMI_PAT_STR

TEXTS = ["Hello, how are you today?", "The capital of France is Paris.", "中文English混合 1234567", "  x\n\n\ty",
         "<|im_user|>user<|im_middle|>hi<|im_end|>"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "Tell me a joke."}]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    out = tmp_path_factory.mktemp("kimi") / "ckpt"
    summary = make_checkpoint("kimi_k2", "tiny", out, dtype="fp32", seed=1, progress=False)
    return out, summary.config


def reference_encoding(out) -> tiktoken.Encoding:
    specials = json.loads((out / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    return tiktoken.Encoding("kimi", pat_str=KIMI_PAT_STR, mergeable_ranks=load_tiktoken_bpe(str(out / "tiktoken.model")),
                             special_tokens={t["content"]: int(i) for i, t in specials.items()})


def test_the_files_are_kimis(kimi):
    out, config = kimi
    assert (out / "tiktoken.model").is_file() and not (out / "tokenizer.json").exists()
    assert config["model_type"] == "kimi_k2" and config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert (config["n_group"], config["topk_group"], config["routed_scaling_factor"]) == (1, 1, 2.827)
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    added = {t["content"]: (int(i), t["special"]) for i, t in tok_config["added_tokens_decoder"].items()}
    first = config["vocab_size"] - 256  # Kimi's 256 special ids follow the ranks
    assert added["[BOS]"] == (first, True) and added["<|im_middle|>"] == (first + 17, True)
    assert added["<|tool_call_begin|>"] == (first + 13, False)  # the tool parser reads it: not special
    assert config["bos_token_id"] == first and config["eos_token_id"] == first + 1
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [first + 2, first + 1]


def test_the_tokenizer_is_tiktokens(kimi):
    out, config = kimi
    enc, ours = reference_encoding(out), Tokenizer.from_dir(out)
    assert enc.n_vocab == ours.vocab_size == config["vocab_size"]
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == enc.encode(text, allowed_special="all"), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert len(ours.encode(" the capital of France")) == 4  # trained merges give word-sized pieces


def test_the_chat_template_is_kimis(kimi):
    out, config = kimi
    tok = Tokenizer.from_dir(out)
    text = tok.apply_chat_template(MESSAGES)
    assert text.startswith("<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>")
    assert text.endswith("<|im_user|>user<|im_middle|>Tell me a joke.<|im_end|><|im_assistant|>assistant<|im_middle|>")
    assert "<|im_assistant|>assistant<|im_middle|>Paris.<|im_end|>" in text
    default = tok.apply_chat_template(MESSAGES[1:2])
    assert default.startswith("<|im_system|>system<|im_middle|>You are Kimi")
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    result = {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"}
    text = tok.apply_chat_template([MESSAGES[1], call, result], tools=[{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object"}}}])
    assert text.startswith("<|im_system|>tool_declare<|im_middle|>[{")
    assert ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>') in text
    assert "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nsunny<|im_end|>" in text
    assert parser_for_template(tok.chat_template).name == "kimi_k2"
    eos = {config["eos_token_id"], *json.loads((out / "generation_config.json").read_text())["eos_token_id"]}
    assert tok.encode_chat(MESSAGES)[-1] == config["vocab_size"] - 256 + 17 and tok.token_to_id("<|im_end|>") in eos


def test_our_engine_generates_what_transformers_generates(kimi, tmp_path):
    out, config = kimi
    prompt = "The capital of France is"
    llm = LLM(out, dtype="float32", expert_backend="torch")
    ids = llm.encode(prompt)
    got = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    # transformers has no kimi_k2 class: the same files with model_type deepseek_v3 load in DeepseekV3ForCausalLM
    hf_dir = tmp_path / "hf"
    shutil.copytree(out, hf_dir)
    (hf_dir / "config.json").write_text(json.dumps({**config, "model_type": "deepseek_v3"}))
    hf = DeepseekV3ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                           pad_token_id=config["vocab_size"] - 1)[0, len(ids):].tolist()
    assert got.token_ids == want
    assert got.text == Tokenizer.from_dir(out).decode(want)


def test_hybridmoe_run_generates_from_it(kimi, capsys):
    out, _ = kimi
    assert main(["run", "--model", str(out), "--prompt", "Once upon a time", "--max-new-tokens", "6",
                 "--temperature", "0", "--ignore-eos"]) == 0
    captured = capsys.readouterr()
    expected = LLM(out).generate("Once upon a time", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
    assert captured.out == expected.text + "\n" and "[6 tokens, length;" in captured.err


def test_structured_output_holds_to_its_regex(kimi):
    out, _ = kimi
    params = SamplingParams(max_tokens=12, temperature=0, structured=StructuredOutput("regex", "(yes|no)[0-9]{3}"))
    got = LLM(out, dtype="float32", expert_backend="torch").generate("Answer:", params)[0]
    assert re.fullmatch("(yes|no)[0-9]{3}", got.text) and got.finish_reason == "stop"


def test_the_real_preset_has_kimi_k2s_parameter_count():
    # 1.03 trillion: Kimi-K2's "1T total parameters" without a multi-token-prediction layer
    assert sum(s.numel for s in tensor_specs(model_config("kimi_k2", "kimi-k2"))) / 1e9 == pytest.approx(1026.41,
                                                                                                         abs=0.01)
