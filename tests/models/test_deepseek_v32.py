"""DeepseekV32ForCausalLM (DeepSeek Sparse Attention) loaded by load_model computes transformers' outputs.

Tiny random float32 models of transformers' own class, saved and loaded back by us; index_topk below the prompt
length makes the indexer's selection matter, index_topk above it makes the layer dense MLA.
"""

import pytest
import torch
from compare import assert_close, assert_forward_equals_transformers, hf_forward, run_step, save_and_load
from deepseek_tiny import TINY, randomize
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, DeepseekV32Config, DeepseekV32ForCausalLM

from hybridmoe import LLM, SamplingParams
from hybridmoe.checkpoint.make import make_checkpoint
from hybridmoe.layers.mla_indexer import index_scores, select_topk

PROMPT = [int(t) for t in torch.randint(0, TINY["vocab_size"], (60,), generator=torch.Generator().manual_seed(1))]
V32 = {"q_lora_rank": 32, "n_group": 4, "topk_group": 2, "index_n_heads": 16, "index_head_dim": 16}


def tiny_v32(index_topk: int) -> DeepseekV32ForCausalLM:
    """A random float32 transformers DeepseekV32ForCausalLM of deepseek_tiny's shape with an indexer."""
    torch.manual_seed(0)
    hf = DeepseekV32ForCausalLM(DeepseekV32Config(**{**TINY, **V32, "index_topk": index_topk})).float().eval()
    randomize(hf)
    with torch.no_grad():
        for layer in hf.model.layers:  # the index keys' LayerNorm bias, which randomize leaves at zero
            layer.self_attn.indexer.k_norm.bias.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(2))
    return hf


@pytest.mark.parametrize("index_topk", [16, 64])
def test_logits_and_hidden_states_equal_transformers(index_topk, tmp_path):
    hf = tiny_v32(index_topk)
    ours = save_and_load(hf, tmp_path, dtype="float32").model
    assert_forward_equals_transformers(ours, hf, PROMPT)


def test_the_sparse_selection_changes_the_logits():
    sparse, dense = hf_forward(tiny_v32(16), PROMPT)[0], hf_forward(tiny_v32(64), PROMPT)[0]
    assert torch.allclose(sparse[:16], dense[:16], atol=1e-5)  # 16 or fewer positions seen: all selected
    assert (sparse[16:] - dense[16:]).abs().max() > 1e-2


def test_topk_at_least_the_length_is_dense_mla(tmp_path):
    """V3.2 with index_topk >= the prompt length computes DeepseekV3's dense MLA with the same weights."""
    v32 = tiny_v32(64)
    v3 = DeepseekV3ForCausalLM(DeepseekV3Config(**{**TINY, **{k: v for k, v in V32.items() if "index" not in k}}))
    missing, unexpected = v3.load_state_dict(v32.state_dict(), strict=False)
    assert not missing and all(".indexer." in k for k in unexpected)
    ours_v32 = save_and_load(v32, tmp_path / "v32", dtype="float32").model
    ours_v3 = save_and_load(v3.float().eval(), tmp_path / "v3", dtype="float32").model
    for m in (ours_v32, ours_v3):
        m.allocate_kv_cache(1, len(PROMPT))
    (a,) = run_step(ours_v32, [PROMPT], slots=[0], start_pos=[0])
    (b,) = run_step(ours_v3, [PROMPT], slots=[0], start_pos=[0])
    assert_close(a, b, what="V3.2 dense vs V3 logits")


def test_chunked_prefill_and_cached_decode_equal_transformers(tmp_path):
    """Two prompts prefilled together in chunks over the paged caches, then 8 greedy decode steps as one batch:
    each step's logits equal transformers' full recomputation of the sequence so far."""
    hf = tiny_v32(16)
    ours = save_and_load(hf, tmp_path, dtype="float32").model
    ours.allocate_kv_cache(2, 80, block_size=4)
    seqs, done = [PROMPT[:45], PROMPT[10:50]], [0, 0]
    while any(d < len(s) for d, s in zip(done, seqs)):
        chunks = [s[d:d + 13] for d, s in zip(done, seqs)]
        logits = run_step(ours, chunks, slots=[0, 1], start_pos=list(done))
        done = [d + len(c) for d, c in zip(done, chunks)]
    for step in range(8):
        for seq, logit in zip(seqs, logits):
            assert_close(logit[-1], hf_forward(hf, seq)[0][-1], what=f"step {step}, length {len(seq)}")
        start = [len(s) for s in seqs]
        for seq, logit in zip(seqs, logits):
            seq.append(int(logit[-1].argmax()))
        logits = run_step(ours, [[s[-1]] for s in seqs], slots=[0, 1], start_pos=start)


def test_kv_bytes_count_the_index_keys(tmp_path):
    ours = save_and_load(tiny_v32(16), tmp_path, dtype="float32").model
    latent, index = TINY["kv_lora_rank"] + TINY["qk_rope_head_dim"], V32["index_head_dim"]
    assert ours.kv_bytes_per_token() == TINY["num_hidden_layers"] * (latent + index) * 4
    assert ours.kv_bytes_per_token(quantized=True) == TINY["num_hidden_layers"] * (latent + 4 + index + 4)
    ours.allocate_kv_blocks(5, 4)
    shapes = sorted(tuple(t.shape) for t in ours.kv_cache_tensors())
    assert shapes == sorted([(5, 4, latent), (5, 4, index)] * TINY["num_hidden_layers"])


def test_greedy_32_tokens_of_make_model_tiny_equal_transformers_generate(tmp_path):
    """make-model's tiny deepseek_v32 (index_topk 8), loaded by both sides; our engine prefills in chunks of at
    most 4 tokens and decodes from its caches, transformers' generate from its indexer cache."""
    from transformers import AutoModelForCausalLM

    make_checkpoint("deepseek_v32", "tiny", tmp_path, dtype="fp32", progress=False, force=True)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "DeepseekV32ForCausalLM" and hf.config.index_topk == 8
    llm = LLM(tmp_path, dtype="float32", max_num_seqs=2, max_num_batched_tokens=4)
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    for prompt in ["The quick brown fox jumps over the lazy dog, and then it runs", "A"]:
        ids = llm.tokenizer.encode(prompt)
        expected = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               do_sample=False, max_new_tokens=32, min_new_tokens=32, eos_token_id=None)
        assert llm.generate(prompt, greedy)[0].token_ids == expected[0, len(ids):].tolist(), prompt


def reference_selection(q, weights, keys, positions, topk):
    """Hand-written float32 lightning-indexer selection: per query, the topk visible keys by
    sum_h w[h] * relu(q[h] . k / sqrt(D)), as a set of key positions."""
    m, heads, dim = q.shape
    chosen = []
    for i in range(m):
        scored = []
        for s in range(positions[i] + 1):
            total = 0.0
            for h in range(heads):
                dot = sum(float(q[i, h, d]) * float(keys[s, d]) for d in range(dim)) / dim ** 0.5
                total += float(weights[i, h]) * max(dot, 0.0)
            scored.append((total, s))
        chosen.append({s for _, s in sorted(scored, reverse=True)[:topk]})
    return chosen


def test_indexer_topk_selection_equals_a_hand_written_reference():
    gen = torch.Generator().manual_seed(3)
    q, keys = torch.randn(6, 3, 8, generator=gen), torch.randn(12, 8, generator=gen)
    weights, positions, topk = torch.randn(6, 3, generator=gen), [0, 2, 4, 7, 9, 11], 4
    visible = torch.arange(12)[None, :] <= torch.tensor(positions)[:, None]
    selected = select_topk(index_scores(q, weights, keys, 8 ** -0.5), visible, topk)
    got = [set(torch.nonzero(row).flatten().tolist()) for row in selected]
    assert got == reference_selection(q, weights, keys, positions, topk)
    assert [len(s) for s in got] == [1, 3, 4, 4, 4, 4]
