"""Tensor parallelism on the CPU (gloo): 2 and 4 processes give one process's greedy tokens and log-probabilities
(float32) for a batch of prompts, for Qwen3-MoE (GQA), DeepSeek-V3 (MLA, a dense layer, shared experts), gpt-oss
(attention sinks cut by query heads, sliding-window layers, expert biases in rank 0's engine), MiniMax-M2 (q/k
norms over all heads, their mean of squares all-reduced), Qwen3-Next and Qwen3.5 (Gated DeltaNet split by key heads
with their value heads, per-rank recurrent states, gated attention; also a prompt re-sent with its reply, whose
cached prefix restores each rank's share of a state snapshot); rank 0 alone holds the routed experts; closing the
LLM (or dropping it) leaves no process behind; a worker that dies fails rank 0's next step instead of hanging it;
what is not built is refused before any worker starts.

The tiny Qwen3-MoE, gpt-oss and MiniMax-M2 have 4 query heads and 2 key/value heads: 2 ranks split them as they are
(one key/value head each), 4 ranks run variants with 4 key/value heads (make_checkpoint's overrides). The tiny
DeepSeek-V3's 4 heads split both ways. The longest prompt (7 tokens) and its 4 new ones reach past gpt-oss's
sliding window of 8 positions. The tiny Qwen3-Next and Qwen3.5 have 2 key heads (each serving 2 value heads) in
their DeltaNet layers and 4 query / 2 key-value heads in their gated attention: 2 ranks split them, 4 ranks run a
Qwen3.5 variant with 4 key heads (8 value heads) and 4 key/value heads."""

import gc
import os
import re
import signal
from pathlib import Path

import pytest
import torch

from hybridmoe.checkpoint.make import make_checkpoint
from hybridmoe.errors import HybridMoEError
from hybridmoe.llm import LLM
from hybridmoe.sampling_params import SamplingParams

PROMPTS = [[1, 5, 9, 33, 2], [7, 8, 100, 200, 300, 42, 11], [3]]
PARAMS = SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)

CHECKPOINTS = {
    "qwen3_moe": ("qwen3_moe", None),
    "qwen3_moe_4kv": ("qwen3_moe", {"num_key_value_heads": 4}),
    "deepseek_v3": ("deepseek_v3", None),
    "gpt_oss": ("gpt_oss", None),
    "gpt_oss_4kv": ("gpt_oss", {"num_key_value_heads": 4}),
    "minimax_m2": ("minimax_m2", None),
    "minimax_m2_4kv": ("minimax_m2", {"num_key_value_heads": 4}),
    "qwen3_next": ("qwen3_next", None),
    "qwen3_5_moe": ("qwen3_5_moe", None),
    "qwen3_5_moe_4kv": ("qwen3_5_moe", {"num_key_value_heads": 4, "linear_num_key_heads": 4,
                                        "linear_num_value_heads": 8}),
}

RECURRENT = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_4kv")
"""The checkpoints with a recurrent state: also run with a prompt re-sent with its reply (resend), in KV blocks of
16 positions (options)."""

LONG_PROMPT = [(7 * i + 3) % 200 + 1 for i in range(21)]
"""Past one KV block (16 positions): its last full block gets a state snapshot that its re-sending restores."""


def options(name: str) -> dict:
    """The LLM's options for checkpoint name, but for tensor parallelism."""
    return {"dtype": "float32", "device": "cpu", **({"kv_block_size": 16} if name in RECURRENT else {})}

SPLIT_PARAMETER = re.compile(r"\.(qkv_proj|q_proj|q_b_proj|kv_b_proj|gate_up_proj)\.(weight|bias)$"
                             r"|\.(o_proj|down_proj)\.weight$|^lm_head\.weight$|\.self_attn\.sinks$"
                             r"|\.linear_attn\.(in_proj_qkvz\.weight|in_proj_ba\.weight|out_proj\.weight"
                             r"|conv1d\.weight|dt_bias|A_log)$")
"""The parameters split across the ranks (every other one is whole on every rank, but QK_NORM's)."""

QK_NORM = re.compile(r"\.self_attn\.[qk]_norm\.weight$")
"""Split where the norm is over all heads together (MiniMax-M2), whole where it is per head (Qwen3)."""


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The one-process references on one thread too: CI's 2 cores run up to 4 ranks (each on a share of them)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for name, (arch, overrides) in CHECKPOINTS.items():
        out[name] = tmp_path_factory.mktemp(name)
        make_checkpoint(arch, "tiny", out[name], dtype="fp32", progress=False, overrides=overrides)
    return out


@pytest.fixture(scope="module")
def one_process(checkpoints):
    """(checkpoint, expert backend) -> (outputs, the model's MoE layers, {world size: a shard's parameter bytes}),
    made once each."""
    made = {}

    def run(name: str, backend: str):
        if (name, backend) not in made:
            with LLM(checkpoints[name], expert_backend=backend, **options(name)) as llm:
                model = llm.engine.runner.model
                outputs = generate(llm) + (resend(llm) if name in RECURRENT else [])
                made[name, backend] = (outputs, model.moe_layers, {w: shard_bytes(model, w) for w in (2, 4)})
        return made[name, backend]
    return run


def generate(llm: LLM, prompts: list[list[int]] = PROMPTS, cached: dict | None = None) -> list[tuple[list[int], list]]:
    """Each prompt's greedy tokens and their log-probabilities, the prompts run as one batch; cached, where given,
    gets each prompt's count of tokens served from the prefix cache."""
    engine = llm.engine
    ids = [engine.add_request(p, PARAMS) for p in prompts]
    tokens, logprobs = {i: [] for i in ids}, {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] = out.token_ids
            logprobs[out.request_id] += out.new_logprobs
            if cached is not None:
                cached[ids.index(out.request_id)] = out.num_cached_tokens
    return [(tokens[i], logprobs[i]) for i in ids]


def resend(llm: LLM) -> list[tuple[list[int], list]]:
    """LONG_PROMPT's reply, then LONG_PROMPT and its reply re-sent: its cached prefix (a full block, at least) starts
    from the state snapshot kept at that block's end."""
    [(reply, lps)] = generate(llm, [LONG_PROMPT])
    cached = {}
    [again] = generate(llm, [LONG_PROMPT + reply], cached)
    assert cached[0] >= 16, "the re-sent prompt reused no cached prefix"
    return [(reply, lps), again]


def shard_bytes(model: torch.nn.Module, world: int) -> int:
    return sum(p.nbytes // world if is_split(model, name) else p.nbytes for name, p in model.named_parameters())


def is_split(model: torch.nn.Module, name: str) -> bool:
    if QK_NORM.search(name):
        return not model.get_submodule(name.rsplit(".", 2)[0]).qk_norm_per_head
    return SPLIT_PARAMETER.search(name) is not None


def child_pids() -> set[int]:
    """This process's live children (from /proc)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended while read
            continue
        if int(fields[1]) == os.getpid():
            found.add(int(stat.parent.name))
    return found


@pytest.mark.parametrize("name, world, backend, ending", [
    ("qwen3_moe", 2, "torch", "close"),
    ("qwen3_moe_4kv", 4, "torch", "close"),
    ("deepseek_v3", 2, "torch", "garbage collection"),
    ("deepseek_v3", 4, "torch", "close"),
    ("qwen3_moe", 2, "native", "close"),
    ("gpt_oss", 2, "native", "close"),
    ("gpt_oss_4kv", 4, "torch", "close"),
    ("minimax_m2", 2, "torch", "close"),
    ("minimax_m2_4kv", 4, "torch", "close"),
    ("qwen3_next", 2, "torch", "close"),
    ("qwen3_5_moe", 2, "torch", "close"),
    ("qwen3_5_moe_4kv", 4, "torch", "close"),
])
def test_ranks_give_one_process_tokens_and_hold_one_expert_engine(one_process, checkpoints, name, world, backend,
                                                                  ending):
    want, moe_layers, shard = one_process(name, backend)
    before = child_pids()
    llm = LLM(checkpoints[name], expert_backend=backend, tensor_parallel_size=world, **options(name))
    workers = llm.engine.tensor_parallel
    pids, reports = workers.pids, workers.reports
    assert len(pids) == world - 1 and set(pids) <= child_pids()
    got = generate(llm) + (resend(llm) if name in RECURRENT else [])
    if ending == "close":
        llm.close()
    else:
        del llm, workers
        gc.collect()
    assert child_pids() <= before

    for (want_tokens, want_lps), (got_tokens, got_lps) in zip(want, got, strict=True):
        assert got_tokens == want_tokens and len(want_tokens) == PARAMS.max_tokens
        for w, g in zip(want_lps, got_lps, strict=True):
            assert [t for t, _ in g.top] == [t for t, _ in w.top]
            assert g.logprob == pytest.approx(w.logprob, abs=1e-5)
            assert [lp for _, lp in g.top] == pytest.approx([lp for _, lp in w.top], abs=1e-5)
    assert [r.rank for r in reports] == list(range(world))
    assert reports[0].routed_expert_layers == moe_layers  # rank 0 holds every routed expert, the others none
    assert all(r.routed_expert_layers == [] for r in reports[1:])
    assert all(r.parameter_bytes == shard[world] for r in reports)


def test_a_killed_worker_fails_rank_0s_next_step_and_a_second_group_is_refused(checkpoints):
    before = child_pids()
    llm = LLM(checkpoints["qwen3_moe"], dtype="float32", device="cpu", expert_backend="torch", tensor_parallel_size=2)
    with pytest.raises(HybridMoEError, match=r"one LLM with tensor_parallel_size > 1 at a time per process"):
        LLM(checkpoints["qwen3_moe"], dtype="float32", device="cpu", expert_backend="torch", tensor_parallel_size=2)
    os.kill(llm.engine.tensor_parallel.pids[0], signal.SIGKILL)
    with pytest.raises(HybridMoEError, match=r"tensor-parallel rank 1 exited \(code -9\)"):
        llm.generate(PROMPTS, PARAMS)
    with pytest.raises(HybridMoEError, match="make a new LLM"):
        llm.generate(PROMPTS, PARAMS)
    llm.close()
    assert child_pids() <= before


@pytest.mark.parametrize("checkpoint, options, message", [
    ("qwen3_moe", {"tensor_parallel_size": 0}, "tensor_parallel_size must be at least 1"),
    ("deepseek_v3", {"tensor_parallel_size": 3}, r"tensor_parallel_size 3 does not divide the attention heads"),
    ("qwen3_moe", {"tensor_parallel_size": 4}, r"does not divide the key/value heads \(num_key_value_heads\) \(2\)"),
    ("qwen3_next", {"tensor_parallel_size": 4}, r"does not divide the linear-attention key heads"),
    ("qwen3_moe", {"tensor_parallel_size": 2, "gpu_experts_per_layer": 2}, "the hybrid GPU/CPU expert split"),
    ("qwen3_moe", {"tensor_parallel_size": 2, "kv_cpu_budget": "1MiB"}, "the KV cache's host tier"),
    ("deepseek_v32", {"tensor_parallel_size": 2}, r"DeepseekV32ForCausalLM cannot run with tensor_parallel_size > 1"),
])
def test_what_it_does_not_run_is_refused_before_a_worker_starts(checkpoints, tmp_path, checkpoint, options, message):
    if checkpoint not in checkpoints:
        checkpoints = {checkpoint: tmp_path / checkpoint}
        make_checkpoint(checkpoint, "tiny", checkpoints[checkpoint], dtype="fp32", progress=False)
    before = child_pids()
    with pytest.raises(HybridMoEError, match=message):
        LLM(checkpoints[checkpoint], dtype="float32", device="cpu", expert_backend="torch", **options)
    assert child_pids() <= before
