"""Fixed-shape decode steps (what a CUDA graph replays) for the families that keep a recurrent state per sequence
(Qwen3-Next, Qwen3.5-MoE), run eagerly on the CPU, give the plain runner's tokens: a batch of prompts of different
lengths (10 rows padded to 16), a request arriving mid-decode, and prefix-cache reuse whose restores and saves fall
in decode steps; the padding rows write only the spare slot, so the real slots' states are the plain runner's and
the unused slots' stay zero.

Each family's checkpoint is loaded twice: the plain engine, and one whose runner is replaced before it runs anything
(a runner allocates the model's caches and states, and the prefix cache must only name blocks that runner wrote).
"""

import pytest
import torch
from arrivals import generate_with_arrival

from hybridmoe import LLM, SamplingParams
from hybridmoe.checkpoint.make import make_checkpoint
from hybridmoe.engine.model_runner import ModelRunner

SLOTS, BLOCK = 16, 16
PROMPTS = [[5, 17, 3, 60, 22, 9, 41], [7, 13], [99, 2, 8, 31, 4], [11], [3, 3, 3], [8, 1], [42] * 9,
           [6, 60, 16], [70, 71], [20, 2, 12, 4]]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def random_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5_moe"])
def engines(request, tmp_path_factory):
    """(plain LLM, LLM whose runner runs fixed-shape decode steps) of the family's tiny checkpoint."""
    path = tmp_path_factory.mktemp(request.param)
    make_checkpoint(request.param, "tiny", path, dtype="fp32", seed=2, progress=False)
    options = {"device": "cpu", "expert_backend": "torch", "max_num_seqs": SLOTS, "max_model_len": 96,
               "kv_block_size": BLOCK}
    plain, fixed = LLM(path, **options), LLM(path, **options)
    engine = fixed.engine
    runner, plan = engine.runner, engine.kv_plan
    engine.runner = ModelRunner(runner.model, SLOTS, runner.max_len, "cpu", fixed_shapes=True,
                                num_blocks=plan.num_blocks, block_size=plan.block_size, num_snapshots=plan.snapshots)
    engine.runner.sampler = runner.sampler
    assert engine.runner.fixed and not engine.runner.lookahead and engine.runner.sample_on_device
    assert plan.snapshots > 0 and engine.config.prefix_caching
    return plain, fixed


def states(llm: LLM) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every DeltaNet layer's (conv, recurrent) state rows, copied."""
    return [(s.conv.clone(), s.recurrent.clone()) for s in llm.engine.runner.model.recurrent_states()]


def test_a_padded_batch_decodes_the_plain_runners_tokens_and_states(engines):
    plain, fixed = engines
    want = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in fixed.generate(PROMPTS, GREEDY)] == want
    used = len(PROMPTS)  # slots 0..9; 10 rows pad to 16, on the spare slot 16
    for (conv, rec), (ref_conv, ref_rec) in zip(states(fixed), states(plain)):
        assert conv.shape[0] == ref_conv.shape[0] + 1  # the spare slot before the snapshots
        torch.testing.assert_close(conv[:used], ref_conv[:used])
        torch.testing.assert_close(rec[:used], ref_rec[:used])
        assert not conv[used:SLOTS].any() and not rec[used:SLOTS].any()  # no padding row wrote a real slot
        assert rec[SLOTS].any()  # the padding rows' slot


def test_a_request_arriving_mid_decode(engines):
    plain, fixed = engines
    want = generate_with_arrival(plain, PROMPTS[:3], GREEDY, arrive_at=3)
    assert generate_with_arrival(fixed, PROMPTS[:3], GREEDY, arrive_at=3) == want


def generate_cached(llm: LLM, prompt: list[int]) -> tuple[list[int], int]:
    """Greedy tokens, and the prompt tokens found in the prefix cache."""
    out = llm.generate(prompt, GREEDY)[0]
    return out.token_ids, out.num_cached_tokens


def test_prefix_cache_reuse_restores_and_saves_states_in_decode_steps(engines):
    """A 28-token prompt whose reply crosses the block boundary at 32 in a decode step (its latest snapshot saved
    there); then the conversation re-sent (prompt, reply, 3 new tokens): it restores that snapshot. A 33-token prompt,
    then the same again: its cached 32 tokens leave one to compute, a decode step that restores the prompt's
    snapshot. Each as the plain engine gives it."""
    plain, fixed = engines
    first, resend = random_prompt(28, seed=1), random_prompt(33, seed=2)
    results = []
    for llm in (plain, fixed):
        reply, cached = generate_cached(llm, first)
        results.append([(reply, cached), generate_cached(llm, first + reply + [9, 8, 7]),
                        generate_cached(llm, resend), generate_cached(llm, resend)])
    assert results[1] == results[0]
    assert [cached for _, cached in results[1]] == [0, 32, 0, 32]
