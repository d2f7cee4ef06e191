"""Batched, chunked prefill and decode through MLA's latent cache equal full recomputation.

Three sequences of different lengths share steps in their own cache slots: prompts arrive
in chunks beside other sequences' decode tokens, then all decode together. Every logit row
we produce is compared with transformers' forward over the whole sequence so far.
"""

import pytest
from compare import assert_close, hf_forward, run_step, save_and_load
from deepseek_tiny import tiny_deepseek

PROMPTS = [[5, 17, 3, 60, 22, 9, 41], [7, 2, 33], [11, 50, 8, 19, 27]]
SLOTS = [1, 2, 0]
# per step, the prompt tokens each sequence brings (0: it decodes its next token instead)
PREFILL_STEPS = [[4, 3, 2], [3, 0, 3]]
DECODE_STEPS = 3


@pytest.mark.parametrize("family,overrides", [
    ("v2", dict(q_lora_rank=None, topk_method="group_limited_greedy", n_group=4, topk_group=2)),
    ("v3", dict(q_lora_rank=32, n_group=4, topk_group=2, norm_topk_prob=True)),
], ids=["v2", "v3"])
def test_chunked_batched_prefill_and_decode_equal_full_recomputation(family, overrides, tmp_path):
    hf = tiny_deepseek(family, **overrides)
    ours = save_and_load(hf, tmp_path, dtype="float32").model
    ours.allocate_kv_cache(num_slots=3, max_len=16)
    seqs = [[] for _ in PROMPTS]  # tokens in each sequence's cache so far
    pending = [list(p) for p in PROMPTS]  # prompt tokens not yet sent
    steps = PREFILL_STEPS + [[0, 0, 0]] * DECODE_STEPS
    next_token = [None] * 3
    for step, chunk_sizes in enumerate(steps):
        chunks = []
        for b, n in enumerate(chunk_sizes):
            chunk, pending[b] = (pending[b][:n], pending[b][n:]) if n else ([next_token[b]], pending[b])
            chunks.append(chunk)
        starts = [len(s) for s in seqs]
        logits = run_step(ours, chunks, SLOTS, starts)
        for b, chunk in enumerate(chunks):
            seqs[b] += chunk
            ref, _ = hf_forward(hf, seqs[b])
            assert_close(logits[b], ref[starts[b]:], what=f"step {step}, sequence {b}")
            next_token[b] = int(logits[b][-1].argmax())
