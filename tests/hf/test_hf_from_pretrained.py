"""hybridmoe.hf.from_pretrained: a checkpoint directory loads as transformers' own model with its routed experts
packed into the native CPU engine as they are read, exactly as transformers' load followed by offload_experts.

Each family's tiny random float32 model (tiny_families.py) is saved by transformers itself, in shards, in the
names its released checkpoints use (one tensor per expert, Mixtral's and MiniMax-M2's block_sparse_moe and
w1/w3/w2; gpt-oss's fused experts and biases). Both loads then hold the same packed experts bit for bit, the same
other weights, and compute the same logits bit for bit (one worker thread each). Unsupported models and
checkpoints missing an expert are refused in one line (quantized checkpoints:
test_hf_from_pretrained_quantized.py).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_families import CASES, VOCAB, tiny_model
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from hybridmoe.errors import CheckpointError, HybridMoEError
from hybridmoe.hf import OffloadedExperts, from_pretrained, offload_experts

PROMPT = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(5))


def offloaded_modules(model) -> dict[str, OffloadedExperts]:
    return {name: m for name, m in model.named_modules() if isinstance(m, OffloadedExperts)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> the directory transformers saved its tiny model to (shards of at most 100KB)."""
    dirs = {}

    def save(family: str):
        if family not in dirs:
            dirs[family] = tmp_path_factory.mktemp(family)
            tiny_model(family).save_pretrained(dirs[family], max_shard_size="100KB")
        return dirs[family]
    return save


@pytest.mark.parametrize("family", list(CASES))
@torch.no_grad()
def test_it_equals_transformers_load_then_offload_bit_for_bit(saved, family):
    path = saved(family)
    assert (path / "model.safetensors.index.json").is_file()
    ours = from_pretrained(path, cpu_threads=1)
    want = offload_experts(AutoModelForCausalLM.from_pretrained(path), cpu_threads=1)
    assert type(ours) is type(want) and ours.dtype == want.dtype == torch.float32
    ours_experts, want_experts = offloaded_modules(ours), offloaded_modules(want)
    assert list(ours_experts) == list(want_experts) and ours_experts
    for name, module in ours_experts.items():
        mine, theirs = module.cpu_experts, want_experts[name].cpu_experts
        assert (mine.glu, mine.has_biases, mine.format) == (theirs.glu, theirs.has_biases, "bf16")
        for e in range(mine.num_experts):
            for got, expected in zip(mine.dequantized(e), theirs.dequantized(e)):
                assert torch.equal(got, expected), f"{name} expert {e}"
    state, want_state = ours.state_dict(), want.state_dict()
    assert list(state) == list(want_state)
    assert all(torch.equal(state[k], want_state[k]) for k in state)
    out, want_out = ours(PROMPT, output_hidden_states=True), want(PROMPT, output_hidden_states=True)
    assert torch.equal(out.logits, want_out.logits)
    assert all(torch.equal(h, w) for h, w in zip(out.hidden_states, want_out.hidden_states))
    assert ours.generation_config.to_dict() == want.generation_config.to_dict()
    assert ours.name_or_path == str(path)


@torch.no_grad()
def test_torch_dtype_sets_the_other_weights_dtype(saved):
    path = saved("gpt_oss")
    ours = from_pretrained(path, torch_dtype=torch.bfloat16, cpu_threads=1)
    want = offload_experts(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16), cpu_threads=1)
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    logits = ours(PROMPT).logits
    assert logits.dtype == torch.bfloat16 and torch.equal(logits, want(PROMPT).logits)
    tokens = ours.generate(PROMPT, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    assert tokens.shape == (1, PROMPT.shape[1] + 4)


def test_an_unsupported_model_is_named(tmp_path):
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(HybridMoEError, match=rf"the model in {tmp_path} \(model_type 'llama'\); it supports Qwen2-MoE"):
        from_pretrained(tmp_path)


def test_a_missing_expert_tensor_is_named(saved, tmp_path):
    AutoModelForCausalLM.from_pretrained(saved("mixtral")).save_pretrained(tmp_path)  # one file
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"is missing tensor model\.layers\.1\.block_sparse_moe\.experts\.5\.w3"):
        from_pretrained(tmp_path, cpu_threads=1)


def test_a_directory_without_config_and_arguments_it_sets_itself_are_refused(saved, tmp_path):
    with pytest.raises(HybridMoEError, match="is not a local model directory"):
        from_pretrained(tmp_path / "nothing")
    with pytest.raises(HybridMoEError, match="sets dtype itself; pass the dtype as torch_dtype"):
        from_pretrained(saved("qwen3_moe"), dtype=torch.bfloat16)
