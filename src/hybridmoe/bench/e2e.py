"""End-to-end generation speed of one model directory: prefill and decode tokens/s, time to first
token, load time and peak RSS. Used by `hybridmoe bench`; bench/suite.py times its rows with _measure.

Prompts are random token ids (any checkpoint works, tokenizer or not); generation is greedy and
ignores EOS, so every request runs exactly gen_len tokens. All requests arrive at once; a warm-up
request runs first so one-time costs stay out of the numbers.
"""

from __future__ import annotations

import platform
import resource
import time
from dataclasses import asdict, dataclass

import torch

from hybridmoe.config import EngineConfig
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.errors import HybridMoEError
from hybridmoe.sampling_params import SamplingParams


@dataclass(frozen=True)
class Workload:
    prompt_len: int = 128
    gen_len: int = 32
    batch: int = 1
    """Requests sent at once."""
    seed: int = 0
    """Seed of the random prompts."""

    def __post_init__(self):
        for name in ("prompt_len", "gen_len", "batch"):
            if getattr(self, name) < 1:
                raise HybridMoEError(f"{name} must be at least 1, got {getattr(self, name)}; "
                                     f"pass --{name.replace('_', '-')} 1 or more")


@dataclass
class E2EResult:
    prefill_tok_s: float
    decode_tok_s: float
    """nan when no token was decoded after the last prompt's prefill (gen_len 1)."""
    ttft_mean_s: float
    ttft_max_s: float
    total_s: float
    generated_tokens: int
    load_s: float
    peak_rss_gib: float
    setup: dict
    """Model, dtype, workload, the engine options as given, torch version, threads, machine."""
    resolved: EngineConfig
    """The engine options with every "auto" resolved (system/auto.py), as the engine ran them."""
    cuda_graph: bool
    """Whether decode steps replayed captured CUDA graphs."""

    def to_json(self) -> dict:
        """{"setup": ..., "result": ...}: what `hybridmoe bench --json` writes."""
        result = {k: v for k, v in asdict(self).items() if k not in ("setup", "resolved", "cuda_graph")}
        return {"setup": self.setup, "result": result}


def run_e2e(model_dir: str, engine_config: EngineConfig, workload: Workload) -> E2EResult:
    """Load model_dir with engine_config, warm up, and time `workload` from the first request to the last token."""
    t0 = time.perf_counter()
    engine = LLMEngine(model_dir, engine_config)
    load_s = time.perf_counter() - t0
    total = workload.prompt_len + workload.gen_len
    if total > engine.max_model_len:
        raise HybridMoEError(
            f"--prompt-len {workload.prompt_len} + --gen-len {workload.gen_len} = {total} exceeds the model's "
            f"context of {engine.max_model_len} tokens; lower --gen-len or --prompt-len, or raise --max-model-len")
    g = torch.Generator().manual_seed(workload.seed)
    prompts = torch.randint(0, engine.vocab_size, (workload.batch, workload.prompt_len), generator=g).tolist()
    _measure(engine, [prompts[0][:8]], 2)  # warm-up
    timings = _measure(engine, prompts, workload.gen_len)
    setup = {"model": str(model_dir), "architecture": engine.model_config.get("architectures"),
             "dtype": str(engine.dtype).removeprefix("torch."), "prompt_len": workload.prompt_len,
             "gen_len": workload.gen_len, "batch": workload.batch, "engine": vars(engine.config),
             "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine()}
    return E2EResult(**timings, load_s=load_s, peak_rss_gib=peak_rss_gib(), setup=setup,
                     resolved=engine.resolved_config, cuda_graph=engine.runner.cuda_graph)


def peak_rss_gib() -> float:
    """The process's peak resident memory so far, in GiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _measure(engine, prompts: list[list[int]], gen_len: int) -> dict:
    """Greedy requests for every prompt at once, gen_len tokens each: prefill and decode tok/s, TTFT."""
    params = SamplingParams(max_tokens=gen_len, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    token_times: list[float] = []  # when each generated token arrived
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            first.setdefault(out.request_id, now)
            token_times.append(now)
    end = time.perf_counter()
    prefill_done = max(first[i] for i in ids)
    decoded_after = sum(t > prefill_done for t in token_times)
    ttft = sorted(first[i] - start for i in ids)
    return {
        "prefill_tok_s": sum(map(len, prompts)) / (prefill_done - start),
        "decode_tok_s": decoded_after / (end - prefill_done) if end > prefill_done else float("nan"),
        "ttft_mean_s": sum(ttft) / len(ttft),
        "ttft_max_s": ttft[-1],
        "total_s": end - start,
        "generated_tokens": len(token_times),
    }


def format_table(r: E2EResult) -> str:
    """A heading line (model, dtype, backend, threads, workload) and one row per measure."""
    s = r.setup
    lines = [f"{s['model']} ({s['dtype']}, {s['engine']['expert_backend']} experts, {s['threads']} threads): "
             f"batch {s['batch']} x prompt {s['prompt_len']} + gen {s['gen_len']}"]
    rows = [("prefill", f"{r.prefill_tok_s:.1f} tok/s"), ("decode", f"{r.decode_tok_s:.1f} tok/s"),
            ("TTFT mean / max", f"{1000 * r.ttft_mean_s:.0f} / {1000 * r.ttft_max_s:.0f} ms"),
            ("load", f"{r.load_s:.1f} s"), ("peak RSS", f"{r.peak_rss_gib:.2f} GiB")]
    width = max(len(k) for k, _ in rows)
    lines += [f"  {k:<{width}}  {v:>16}" for k, v in rows]
    return "\n".join(lines)

