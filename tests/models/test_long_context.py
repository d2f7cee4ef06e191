"""The paged KV cache through the whole engine: an 8K-token prompt gives transformers' greedy tokens, prefix
caching and preemption leave every output as it would be without them, and more concurrent sequences than the
cache holds at once all finish with their own tokens.

Checkpoints come from make-model's tiny presets (float32), their max_position_embeddings raised to 16384 so an
8K-token prompt is inside what the model knows; transformers loads the same directory.
"""

import json

import pytest
import torch

from hybridmoe import LLM, SamplingParams
from hybridmoe.checkpoint.make import make_checkpoint
from hybridmoe.models.registry import ARCHITECTURES

FAMILIES = {"qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def long_checkpoint(family, path):
    pytest.importorskip(ARCHITECTURES[FAMILIES[family]][0])
    make_checkpoint(family, "tiny", path, dtype="fp32", progress=False, force=True)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 16384
    (path / "config.json").write_text(json.dumps(config))
    return path


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    return long_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def test_greedy_tokens_after_an_8k_token_prompt_equal_transformers(checkpoint):
    from transformers import AutoModelForCausalLM

    llm = LLM(checkpoint, dtype="float32")  # chunks of 2048 tokens into blocks of 64
    prompt = random_prompt(8192, llm.engine.vocab_size, seed=0)
    out = llm.generate(prompt, GREEDY)[0]
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="sdpa").eval()
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               do_sample=False, max_new_tokens=8, min_new_tokens=8)[0, len(prompt):]
    assert out.token_ids == expected.tolist()


def test_prefix_caching_reuses_blocks_and_changes_no_output(checkpoint):
    on = LLM(checkpoint, dtype="float32", kv_block_size=16)
    off = LLM(checkpoint, dtype="float32", kv_block_size=16, prefix_caching=False)
    vocab = on.engine.vocab_size
    system = random_prompt(300, vocab, seed=1)  # a shared conversation start, re-sent with new turns
    turns = [system + random_prompt(n, vocab, seed=2 + n) for n in (5, 40, 77)]
    for i, prompt in enumerate(turns):
        got, want = on.generate(prompt, GREEDY)[0], off.generate(prompt, GREEDY)[0]
        assert got.token_ids == want.token_ids
        assert want.num_cached_tokens == 0
        assert got.num_cached_tokens == (0 if i == 0 else 300 // 16 * 16)
    # the whole earlier request again, its reply included: everything but the last block comes from the cache
    again = turns[2] + on.generate(turns[2], GREEDY)[0].token_ids
    got = on.generate(again, GREEDY)[0]
    assert got.token_ids == off.generate(again, GREEDY)[0].token_ids
    assert got.num_cached_tokens == (len(again) - 1) // 16 * 16


def test_more_sequences_than_the_cache_holds_finish_with_their_own_tokens(checkpoint):
    alone = LLM(checkpoint, dtype="float32", kv_block_size=16)
    vocab = alone.engine.vocab_size
    prompts = [random_prompt(20 + 7 * i, vocab, seed=100 + i) for i in range(64)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected = [alone.generate(p, params)[0].token_ids for p in prompts]
    # 64 sequences of up to 485 tokens in a cache of 40 blocks of 16 (640 tokens): most wait, some are preempted
    per_token = alone.engine.kv_plan.bytes_per_token
    tight = LLM(checkpoint, dtype="float32", kv_block_size=16, max_num_seqs=64, max_num_batched_tokens=256,
                kv_cache_budget=40 * 16 * per_token, max_model_len=512)
    outs = tight.generate(prompts, [params] * len(prompts))
    assert [o.token_ids for o in outs] == expected
    sched = tight.engine.scheduler
    assert sched.num_preemptions > 0
    assert sched.pool.num_free == sched.pool.usable_blocks and all(r == 0 for r in sched.pool.refs)


def test_a_preempted_sequence_resumes_with_the_tokens_it_would_have_had(checkpoint):
    alone = LLM(checkpoint, dtype="float32", kv_block_size=16)
    vocab = alone.engine.vocab_size
    prompts = [random_prompt(100, vocab, seed=7), random_prompt(90, vocab, seed=8)]
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    expected = [alone.generate(p, params)[0].token_ids for p in prompts]
    # 17 blocks of 16 hold one sequence of 160 tokens, not two: the later one is preempted as they grow
    per_token = alone.engine.kv_plan.bytes_per_token
    tight = LLM(checkpoint, dtype="float32", kv_block_size=16, max_num_seqs=2, kv_cache_budget=17 * 16 * per_token,
                max_model_len=256, prefix_caching=False)
    assert [o.token_ids for o in tight.generate(prompts, [params, params])] == expected
    assert tight.engine.scheduler.num_preemptions > 0


def test_a_prefix_evicted_to_the_host_tier_comes_back_with_the_same_output(checkpoint):
    reference = LLM(checkpoint, dtype="float32", kv_block_size=16, prefix_caching=False)
    per_token = reference.engine.kv_plan.bytes_per_token
    vocab = reference.engine.vocab_size
    conversation, others = random_prompt(200, vocab, seed=20), [random_prompt(200, vocab, seed=21 + i) for i in range(2)]
    resent = conversation + random_prompt(30, vocab, seed=30)
    want = reference.generate(resent, GREEDY)[0].token_ids
    for host_budget, cached in ((0, 0), (64 * 16 * per_token, 192)):
        # 20 blocks of 16: the two other prompts evict the conversation's blocks from the cache
        llm = LLM(checkpoint, dtype="float32", kv_block_size=16, kv_cache_budget=20 * 16 * per_token,
                  max_model_len=256, kv_cpu_budget=host_budget)
        llm.generate(conversation, GREEDY)
        for other in others:
            llm.generate(other, GREEDY)
        got = llm.generate(resent, GREEDY)[0]
        assert got.token_ids == want
        assert got.num_cached_tokens == cached  # 12 full blocks of the conversation, back from the host


def test_yarn_positions_past_the_original_length_give_transformers_tokens(tmp_path):
    """Qwen3's long-context recipe: a YaRN rope_scaling added to config.json (factor 4 over 512 positions);
    a prompt well past the original length gives transformers' greedy tokens."""
    from transformers import AutoModelForCausalLM

    pytest.importorskip(ARCHITECTURES["Qwen3MoeForCausalLM"][0])
    make_checkpoint("qwen3_moe", "tiny", tmp_path, dtype="fp32", progress=False, force=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(tmp_path, dtype="float32", kv_block_size=16)
    assert llm.engine.max_model_len == 2048
    prompt = random_prompt(1800, llm.engine.vocab_size, seed=5)
    out = llm.generate(prompt, GREEDY)[0]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="sdpa").eval()
    assert hf.config.rope_scaling["rope_type"] == "yarn"
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               do_sample=False, max_new_tokens=8, min_new_tokens=8)[0, len(prompt):]
    assert out.token_ids == expected.tolist()
