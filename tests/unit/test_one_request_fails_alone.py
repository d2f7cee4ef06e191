"""A step that fails for one sequence ends that sequence alone: its output says finish_reason "error" and why,
and every other sequence of the batch gets the tokens it gets alone. The sampler's failures (a row of NaN
logits, a row with no drawable token) are reported per row; a request with a parameter the engine cannot hold
(top_k above the vocabulary) is refused when it is added."""

import pytest
import torch

from hybridmoe import LLM, SamplingParams
from hybridmoe.engine.sampler import Sampler, SamplerInput
from hybridmoe.errors import HybridMoEError

PROMPTS = [[5, 17, 3, 60, 22], [7, 13, 2], [99, 2, 8]]
GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=5, temperature=0.8, top_k=20, seed=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_qwen3_fp32):
    return LLM(tiny_qwen3_fp32, device="cpu", expert_backend="torch", max_num_seqs=8, max_model_len=32)


def generate(llm, params):
    return {o.request_id: o for o in llm.generate(PROMPTS, params)}


def test_a_sequence_whose_sampling_fails_ends_alone_and_the_others_keep_their_tokens(llm):
    params = [GREEDY, SAMPLED, GREEDY]
    solo = [llm.generate([p], [q])[0].token_ids for p, q in zip(PROMPTS, params)]
    runner = llm.engine.runner
    real = runner.sampler

    class PoisonSecond:  # the batch's row of the second prompt gets NaN logits from its third token on
        def sample(self, logits, seqs):
            for j, s in enumerate(seqs):
                if s.prompt_ids == PROMPTS[1] and len(s.output_ids) >= 2:
                    logits[j] = float("nan")
            return real.sample(logits, seqs)

    runner.sampler = PoisonSecond()
    try:
        outs = llm.generate(PROMPTS, params)
    finally:
        runner.sampler = real
    assert [o.finish_reason for o in outs] == ["length", "error", "length"]
    assert outs[1].error == "sampling failed: the logits hold NaN" and outs[1].token_ids == solo[1][:2]
    assert outs[0].token_ids == solo[0] and outs[2].token_ids == solo[2]
    assert outs[0].error is None
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == solo  # the engine goes on as before


def rows(*params):
    """Sampler rows, each drawing from its own generator (as a seeded Sequence does)."""
    return [SamplerInput(p, [1, 2], [3], torch.Generator().manual_seed(i)) for i, p in enumerate(params)]


def test_the_sampler_reports_failed_rows_and_samples_the_others():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    want = Sampler().sample(logits.clone(), rows(GREEDY, SAMPLED, SAMPLED))[0]
    bad = logits.clone()
    bad[1, :] = float("nan")
    tokens, failed = Sampler().sample(bad, rows(GREEDY, SAMPLED, SAMPLED))
    assert tokens == [want[0], None, want[2]] and failed == {1: "the logits hold NaN"}
    inf = logits.clone()
    inf[2, :] = float("-inf")  # nothing left to draw
    tokens, failed = Sampler().sample(inf, rows(GREEDY, SAMPLED, SAMPLED))
    assert tokens[:2] == want[:2] and tokens[2] is None and "no token" in failed[2]
    with pytest.raises(HybridMoEError, match="sampling row 1 failed"):
        Sampler()(bad, rows(GREEDY, SAMPLED, SAMPLED))


def test_top_k_above_the_vocabulary_is_refused_when_added(llm):
    vocab = llm.engine.vocab_size
    with pytest.raises(HybridMoEError, match=f"top_k must be at most the vocabulary's {vocab} tokens"):
        llm.engine.add_request(PROMPTS[0], SamplingParams(top_k=vocab + 1))
    llm.engine.add_request(PROMPTS[0], SamplingParams(top_k=vocab, max_tokens=1), "edge")
    llm.engine.abort("edge")
