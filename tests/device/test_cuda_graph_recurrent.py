"""Decode steps of a model with a recurrent state per sequence (Qwen3-Next: Gated DeltaNet layers on their Triton
kernels) replayed as CUDA graphs give the tokens of the same fixed-shape steps run eagerly (--no-cuda-graph): batch
1, a batch of 10 padded to 16 rows (its padding rows on the spare slot), a request arriving mid-decode (a graph
captured while other sequences' states are live: its warm-up must leave them as they were), and prefix-cache reuse
whose snapshot restores and saves fall in decode steps; float32 and bfloat16. The graphs also decode the all-CPU
reference's greedy tokens teacher-forced with its logprobs (logprobs_close.py). Runs on the GPU host through
scripts/device_check.sh.
"""

import pytest
import torch
from arrivals import generate_with_arrival
from logprobs_close import assert_logprobs_close, generate_forced

from hybridmoe import LLM, SamplingParams
from hybridmoe.checkpoint.make import make_checkpoint

pytestmark = [pytest.mark.device,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [[5, 17, 3, 60, 22, 9, 41], [7, 13], [99, 2, 8, 31, 4], [11], [3, 3, 3], [8, 1], [42] * 9,
           [6, 60, 16], [70, 71], [20, 2, 12, 4]]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
WITH_LOGPROBS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=20)
HYBRID = {"expert_backend": "native", "expert_format": "bf16", "gpu_experts_per_layer": 3, "max_num_seqs": 16,
          "max_model_len": 128, "kv_block_size": 16}
BUDGET = 1 << 30


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"qwen3_next_{request.param}")
    make_checkpoint("qwen3_next", "tiny", path, dtype=request.param, seed=1, progress=False)
    return path


def random_prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def with_prefix_reuse(llm: LLM) -> list[tuple[list[int], int]]:
    """A 24-token prompt whose reply crosses the block boundary at 32 in a decode step (the sequence's latest
    snapshot saved there), then the conversation re-sent; a 33-token prompt twice (the second computes one token, a
    decode step restoring the prompt's snapshot). Each request's (tokens, cached prompt tokens)."""
    first, twice = random_prompt(24, seed=1), random_prompt(33, seed=2)
    outs = [llm.generate(first, GREEDY)[0]]
    outs.append(llm.generate(first + outs[0].token_ids + [9, 8, 7], GREEDY)[0])
    outs += [llm.generate(twice, GREEDY)[0] for _ in range(2)]
    return [(o.token_ids, o.num_cached_tokens) for o in outs]


def runs(llm: LLM) -> list:
    """Batch 1, batch 10 (16 rows), a request arriving mid-decode, prefix reuse."""
    return [[o.token_ids for o in llm.generate(PROMPTS[:1], GREEDY)],
            [o.token_ids for o in llm.generate(PROMPTS, GREEDY)],
            generate_with_arrival(llm, PROMPTS[:3], GREEDY, arrive_at=3), with_prefix_reuse(llm)]


def test_graph_replay_equals_eager(checkpoint):
    graphs = LLM(checkpoint, device="cuda", gpu_memory_budget=BUDGET, **HYBRID)
    runner = graphs.engine.runner
    assert runner.cuda_graph and runner.sample_on_device and not runner.lookahead
    got = runs(graphs)
    assert (16, 64) in runner.captured and (3, 64) in runner.captured  # padded rows; the arrival's batch
    assert [cached for _, cached in got[3]] == [0, 32, 0, 32]
    eager = LLM(checkpoint, device="cuda", gpu_memory_budget=BUDGET, cuda_graph=False, **HYBRID)
    assert eager.engine.runner.fixed and not eager.engine.runner.captured
    assert runs(eager) == got


def test_graph_replay_decodes_the_cpu_references_tokens_with_its_logprobs(checkpoint):
    reference_llm = LLM(checkpoint, device="cpu", **HYBRID)
    tokens = [o.token_ids for o in reference_llm.generate(PROMPTS, WITH_LOGPROBS)]
    want = list(zip(tokens, generate_forced(reference_llm, PROMPTS, WITH_LOGPROBS, tokens)))  # its own, per step
    graphs = LLM(checkpoint, device="cuda", gpu_memory_budget=BUDGET, **HYBRID)
    forced = generate_forced(graphs, PROMPTS, WITH_LOGPROBS, tokens)
    assert graphs.engine.runner.captured == [(16, 64)]
    assert_logprobs_close(forced, want, PROMPTS, reference_llm)
