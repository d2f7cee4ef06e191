"""Decode steps replayed as CUDA graphs (CPU experts included, through the native handoff) give
the tokens of eager execution (--no-cuda-graph) and of the all-CPU reference, batch 1 and 4,
float32 and bfloat16; with 1 or 2 deferred experts, graphs equal eager; peak GPU memory stays within
the budget. Runs on the GPU host through scripts/device_check.sh.

Graphs and eager run the same fixed-shape kernels, so their tokens are equal. The CPU reference
(the same GPU/CPU expert split, the CPU standing in for the GPU) computes with other kernels, so
the graphs decode its greedy tokens teacher-forced and their logprobs are held to its step by step
(logprobs_close.py: within a tolerance of the dtype, except at a routing near-tie).
"""

import json

import pytest
import torch
from logprobs_close import assert_logprobs_close, generate_forced

from hybridmoe import LLM, SamplingParams
from hybridmoe.checkpoint.make import make_checkpoint

pytestmark = [pytest.mark.device,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [[5, 17, 3, 60, 22, 9, 41], [7, 13], [99, 2, 8, 31, 4], [11]]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=20)
BUDGET = 1 << 30
HYBRID = dict(expert_backend="native", expert_format="bf16", gpu_experts_per_layer=3, max_num_seqs=4,
              max_model_len=64)


@pytest.fixture(scope="module", params=[("qwen3_moe", "fp32"), ("qwen3_moe", "bf16"), ("deepseek_v3", "fp32"),
                                        ("deepseek_v3", "bf16")], ids="-".join)
def checkpoint(request, tmp_path_factory):
    family, dtype = request.param
    path = tmp_path_factory.mktemp(f"{family}_{dtype}")
    make_checkpoint(family, "tiny", path, dtype=dtype, seed=1, progress=False)
    return path


def generate(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list]]:
    """Each prompt's greedy tokens and their TokenLogprobs, the prompts run as one batch."""
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    tokens, logprobs = {i: [] for i in ids}, {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += out.new_logprobs
    return [(tokens[i], logprobs[i]) for i in ids]


def runs(llm: LLM) -> list[tuple[list[int], list]]:
    """Batch 1, then batch 4."""
    return generate(llm, PROMPTS[:1]) + generate(llm, PROMPTS)


def tokens_of(results) -> list[list[int]]:
    return [t for t, _ in results]


def runs_forced(llm: LLM, reference) -> list[list]:
    """runs(llm), each sequence decoding reference's tokens (teacher-forced): its TokenLogprobs per step."""
    tokens = tokens_of(reference)
    return generate_forced(llm, PROMPTS[:1], GREEDY, tokens[:1]) + generate_forced(llm, PROMPTS, GREEDY, tokens[1:])


def assert_close_to(llm: LLM, reference_llm: LLM, reference) -> None:
    """llm's logprobs decoding the reference's tokens are the reference's (logprobs_close.py)."""
    assert_logprobs_close(runs_forced(llm, reference), reference, PROMPTS[:1] + PROMPTS, reference_llm)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """The all-CPU reference: its LLM and its runs."""
    llm = LLM(checkpoint, device="cpu", **HYBRID)
    return llm, runs(llm)


def test_graph_replay_equals_eager_and_the_cpu_reference(checkpoint, reference):
    reference_llm, want = reference
    torch.cuda.reset_peak_memory_stats()
    graphs = LLM(checkpoint, device="cuda", gpu_memory_budget=BUDGET, **HYBRID)
    got = runs(graphs)
    assert graphs.engine.runner.captured == [(1, 64), (4, 64)]
    assert torch.cuda.max_memory_allocated() <= BUDGET
    eager = LLM(checkpoint, device="cuda", gpu_memory_budget=BUDGET, cuda_graph=False, **HYBRID)
    assert eager.engine.runner.fixed and not eager.engine.runner.captured  # the handoff, eagerly
    assert tokens_of(got) == tokens_of(runs(eager))
    assert_close_to(graphs, reference_llm, want)


@pytest.mark.parametrize("deferred", [1, 2])
def test_graph_replay_equals_eager_with_deferred_experts(checkpoint, deferred):
    top_k = json.loads((checkpoint / "config.json").read_text())["num_experts_per_tok"]
    if deferred >= top_k:
        pytest.skip(f"the model routes {top_k} experts per token")
    options = dict(device="cuda", gpu_memory_budget=BUDGET, deferred_experts=deferred, **HYBRID)
    graphs = LLM(checkpoint, **options)
    got = runs(graphs)
    assert graphs.engine.runner.captured
    assert tokens_of(got) == tokens_of(runs(LLM(checkpoint, cuda_graph=False, **options)))
    # the deferral of the CPU reference (the synchronous path: one layer's CPU calls after another's)
    reference_llm = LLM(checkpoint, device="cpu", deferred_experts=deferred, **HYBRID)
    assert_close_to(graphs, reference_llm, runs(reference_llm))


def test_decode_thread_helping_its_pool_gives_the_same_tokens(checkpoint):
    # HybridExperts.wait_step: the decode thread works in the handoffs' pool while it waits for its step
    # (the default) or spins in CUDA's wait; the layers' items then run on one more thread or not.
    llm = LLM(checkpoint, device="cuda", gpu_memory_budget=BUDGET, **HYBRID)
    experts = llm.engine.runner.model.experts
    assert experts.tuning.help_decode_wait
    helped = runs(llm)
    experts.tuning.help_decode_wait = False
    assert tokens_of(runs(llm)) == tokens_of(helped)
