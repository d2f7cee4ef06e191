"""Generation through the whole engine equals transformers, for every family we load.

Checkpoints come from make-model's tiny presets (float32, with tokenizer); transformers loads
the same directory, so both sides run the same weights.
"""

import pytest
import torch

from hybridmoe import LLM, SamplingParams
from hybridmoe.checkpoint.make import make_checkpoint
from hybridmoe.models.registry import ARCHITECTURES

FAMILIES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
            "mixtral": "MixtralForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
            "deepseek_v3": "DeepseekV3ForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
            "minimax_m2": "MiniMaxM2ForCausalLM", "gpt_oss": "GptOssForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
            "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}
PROMPTS = ["The quick brown fox", "Hello! How are you today? I am fine, thank", "A"]
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    pytest.importorskip(ARCHITECTURES[FAMILIES[request.param]][0])
    d = tmp_path_factory.mktemp(request.param)
    make_checkpoint(request.param, "tiny", d, dtype="fp32", progress=False, force=True)
    return d


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # generate all 32 tokens, like ignore_eos
    return model


def test_greedy_32_tokens_equal_transformers_generate(checkpoint, hf_model):
    llm = LLM(checkpoint, dtype="float32")
    for prompt in PROMPTS:
        ids = llm.tokenizer.encode(prompt)
        expected = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     do_sample=False, max_new_tokens=32, min_new_tokens=32)[0, len(ids):]
        out = llm.generate(prompt, GREEDY)[0]
        assert out.token_ids == expected.tolist(), prompt
        assert out.finish_reason == "length" and out.num_prompt_tokens == len(ids)


def test_a_batch_of_different_lengths_equals_one_by_one(checkpoint):
    alone = LLM(checkpoint, dtype="float32")
    expected = [alone.generate(p, GREEDY)[0].token_ids for p in PROMPTS]
    # A small token budget: prompts are prefilled in chunks inside steps that also decode others.
    batched = LLM(checkpoint, dtype="float32", max_num_seqs=3, max_num_batched_tokens=4)
    assert [o.token_ids for o in batched.generate(PROMPTS, GREEDY)] == expected
