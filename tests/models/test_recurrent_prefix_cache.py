"""Prefix caching and preemption for the families that keep a recurrent state per sequence (Qwen3-Next, Qwen3.5-MoE):
a reused prefix restores the Gated DeltaNet states kept at its last block (engine/state_snapshots.py), and every
output equals the cold run's and transformers' (logits, hidden states, 32 greedy tokens).

Checkpoints come from make-model's tiny presets (float32); transformers loads the same directory.
"""

import pytest
import torch
from compare import assert_close, hf_forward
from transformers import AutoModelForCausalLM

from hybridmoe import LLM, SamplingParams
from hybridmoe.checkpoint.make import make_checkpoint
from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.forward_context import Context, use_context
from hybridmoe.kv_plan import plan_kv_cache
from hybridmoe.models.registry import load_config

FAMILIES = ("qwen3_next", "qwen3_5_moe")
BLOCK = 16
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=1)


def random_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """make-model's tiny checkpoint of the family, and transformers' model of it."""
    path = tmp_path_factory.mktemp(request.param)
    make_checkpoint(request.param, "tiny", path, dtype="fp32", progress=False)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def step(model, tokens: list[int], slot: int, start: int, table: torch.Tensor, hidden: list | None = None,
         **snapshots) -> torch.Tensor:
    """One sequence's tokens at positions start.. through the model, in slot's row of the block table; its logits.
    snapshots: the context's state_restores / state_saves."""
    ctx = Context(slot_ids=[slot], start_pos=[start], cu_seqlens=[0, len(tokens)], block_table=table, **snapshots)
    with use_context(ctx):
        out = model(torch.tensor(tokens), torch.arange(start, start + len(tokens)), hidden)
    return model.compute_logits(out)


def test_a_snapshot_restored_into_another_slot_continues_as_transformers(family):
    """Slot 0 computes a 100-token prompt in steps of 46 and 54 tokens, keeping its state after 48 (2 tokens into
    the second step: the convolution's state there still holds inputs from before the step) in snapshot 1; slot 1
    shares slot 0's first 3 blocks (a cached prefix), restores snapshot 1 and computes tokens 48..99 in two steps (a
    prefill, then one token, the batched recurrent path, saving into snapshot 0): its logits and every layer's
    hidden states equal transformers' on the whole prompt."""
    path, hf = family
    model = load_model(path, EngineConfig(dtype="float32")).model
    model.allocate_kv_blocks(16, BLOCK)
    model.allocate_state(2, num_snapshots=2)
    prompt = random_prompt(100, seed=1)
    table = torch.zeros(2, 8, dtype=torch.int32)
    table[0] = torch.arange(1, 9)
    table[1] = torch.cat([table[0, :3], torch.arange(9, 14)])
    step(model, prompt[:46], 0, 0, table)
    step(model, prompt[46:], 0, 46, table, state_saves=[(0, 2, 1)])
    with pytest.raises(RuntimeError, match="slot 1's recurrent state holds 0 positions and the step starts at 48"):
        step(model, prompt[48:99], 1, 48, table)  # the prefix's keys and values alone do not continue it
    hidden: list[torch.Tensor] = []
    logits = step(model, prompt[48:99], 1, 48, table, hidden, state_restores=[(1, 1)])
    last = step(model, prompt[99:], 1, 99, table, state_saves=[(0, 1, 0)])
    ref_logits, ref_hidden = hf_forward(hf, prompt)
    assert_close(torch.cat([logits, last]), ref_logits[48:], what="logits")
    for i in range(len(ref_hidden) - 1):  # transformers' last one is after the final norm; ours are all before
        assert_close(hidden[i], ref_hidden[i][48:99], what=f"hidden state {i}")
    # snapshot 0 holds slot 1's state after all 100 tokens: slot 0 continues from it as from its own
    table[0] = table[1]
    (going,) = step(model, [5], 0, 100, table, state_restores=[(0, 0)])
    assert_close(going, hf_forward(hf, prompt + [5])[0][-1], what="logits after a decode step's snapshot")


def generate(llm: LLM, prompt: list[int]) -> tuple[list[int], list[float], int]:
    """Greedy tokens, their log-probabilities, and the prompt tokens found in the prefix cache."""
    tokens, logprobs, cached = [], [], 0
    for out in llm.stream(prompt, GREEDY):
        tokens += out.new_token_ids
        logprobs += [lp.logprob for lp in out.new_logprobs]
        cached = out.num_cached_tokens
    return tokens, logprobs, cached


def test_a_resent_conversation_reuses_its_prefix_and_gives_the_cold_runs_tokens_and_logits(family):
    """A 70-token prompt, then the conversation re-sent with its 32-token reply and 13 new tokens: the second request
    starts at the reply's last full block (96 of its 101 computed tokens), and its tokens and logits equal the cold
    engine's and transformers'. Prefill runs in steps of 40 tokens, so the kept states fall inside steps."""
    path, hf = family
    warm = LLM(path, dtype="float32", kv_block_size=BLOCK, max_num_batched_tokens=40)
    cold = LLM(path, dtype="float32", kv_block_size=BLOCK, max_num_batched_tokens=40, prefix_caching=False)
    prompt = random_prompt(70, seed=2)
    reply, _, cached = generate(warm, prompt)
    assert cached == 0
    resent = prompt + reply + random_prompt(13, seed=3)
    tokens, logprobs, cached = generate(warm, resent)
    want_tokens, want_logprobs, none = generate(cold, resent)
    assert cached == 96 and none == 0
    assert tokens == want_tokens
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-5, rtol=1e-5)
    # transformers over the conversation and our tokens: its greedy choice at every step is ours (so its greedy
    # generation gives the same 32 tokens), with the same log-probabilities
    hf_logits = hf_forward(hf, resent + tokens[:-1])[0][len(resent) - 1:]
    assert hf_logits.argmax(-1).tolist() == tokens
    hf_logprobs = hf_logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert_close(torch.tensor(logprobs), hf_logprobs, what="log-probabilities of the greedy tokens")
    # the first prompt again: its last full block (64) has the state kept at the prompt's end
    again = warm.generate(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert again.token_ids == reply[:4] and again.num_cached_tokens == 64
    snapshots = warm.engine.scheduler.pool.snapshots
    assert snapshots.stats.restored == 2


def test_sixteen_sequences_in_a_small_cache_finish_with_their_own_tokens_and_leave_nothing_behind(family):
    """16 sequences (8 prompts, each twice) whose blocks exceed the cache several times over: sequences are
    preempted and come back, some from a kept state, and each gives the tokens it gives without preemption or
    prefix caching (the 8 prompts batched, which gives each its tokens alone: test_qwen3_next). After the run every
    block is free and every snapshot row free or holding the state at a block the prefix cache still has."""
    path, _ = family
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = [random_prompt(20 + 5 * i, seed=10 + i) for i in range(8)]
    reference = LLM(path, dtype="float32", kv_block_size=BLOCK, prefix_caching=False)
    expected = [o.token_ids for o in reference.generate(prompts, [params] * 8)]
    assert reference.engine.scheduler.num_preemptions == 0
    plan = reference.engine.kv_plan
    per_seq = plan.state_bytes // reference.engine.config.max_num_seqs
    # 16 live states, 24 blocks of 16 and, from the rest, state snapshots: 16 sequences of 3 to 5 blocks do not fit
    tight = LLM(path, dtype="float32", kv_block_size=BLOCK, max_num_seqs=16, max_num_batched_tokens=64,
                kv_cache_budget=24 * BLOCK * plan.bytes_per_token + (16 + 8) * per_seq, max_model_len=128)
    assert tight.engine.kv_plan.snapshots > 0 and tight.engine.kv_plan.tokens < 16 * 3 * BLOCK
    outs = tight.generate(prompts + prompts, [params] * 16)
    assert [o.token_ids for o in outs] == expected + expected
    sched = tight.engine.scheduler
    pool, snapshots = sched.pool, sched.pool.snapshots
    assert sched.num_preemptions > 0 and snapshots.stats.restored > 0
    assert pool.num_free == pool.usable_blocks and all(r == 0 for r in pool.refs)
    assert not sched.running and len(sched.free_slots) == 16
    rows = sorted([*snapshots.rows().values(), *snapshots.free_rows])
    assert rows == list(range(snapshots.num_snapshots))
    assert all(pool.is_cached(d) for d in snapshots.entries)


def test_the_kv_plan_keeps_two_snapshots_per_sequence_within_half_of_a_budget(family):
    path, _ = family
    _, config = load_config(path)
    per_seq, per_token = 10_000, 100

    def plan(**options):
        return plan_kv_cache(config, EngineConfig(device="cpu", max_num_seqs=3, kv_block_size=16, **options),
                             per_token, state_bytes_per_seq=per_seq)

    free = plan()
    assert (free.state_bytes, free.snapshots, free.snapshot_bytes) == (3 * per_seq, 6, 6 * per_seq)
    assert free.bytes == free.num_blocks * 16 * per_token + (3 + 6) * per_seq
    assert "and 6 prefix snapshots of them" in free.line()
    # the live states first; of the rest less one block, at most half to snapshots (2 of 10 KB), the blocks the rest
    budget = plan(kv_cache_budget=3 * per_seq + 16 * per_token + 50_000)
    assert budget.snapshots == 2 and budget.num_blocks - 1 == (16 * per_token + 50_000 - 2 * per_seq) // 1600
    assert plan(prefix_caching=False).snapshots == 0 and plan(prefix_caching=False).snapshot_bytes == 0
    gpu = plan_kv_cache(config, EngineConfig(device="cuda", max_num_seqs=3, kv_block_size=16), per_token,
                        state_bytes_per_seq=per_seq)
    assert gpu.state_bytes == 4 * per_seq  # a GPU's fixed-shape steps run their padding rows on a spare slot
