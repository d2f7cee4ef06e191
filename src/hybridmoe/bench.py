"""End-to-end generation speed of one model directory: prefill and decode tokens/s, time to first
token, load time and peak RSS. Used by `hybridmoe bench` and benchmarks/e2e.py.

Prompts are random token ids (any checkpoint works, tokenizer or not); generation is greedy and
ignores EOS, so every request runs exactly gen_len tokens. All requests arrive at once; a warm-up
request runs first so one-time costs stay out of the numbers.
"""

from __future__ import annotations

import platform
import resource
import time
from dataclasses import asdict, dataclass

from hybridmoe.config import EngineConfig
from hybridmoe.errors import HybridMoEError


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
        """{"setup": ..., "result": ...}: the layout benchmarks/e2e.py has always written."""
        result = {k: v for k, v in asdict(self).items() if k not in ("setup", "resolved", "cuda_graph")}
        return {"setup": self.setup, "result": result}


def run_e2e(model_dir: str, engine_config: EngineConfig, workload: Workload) -> E2EResult:
    """Load model_dir with engine_config, warm up, and time `workload` from the first request to the last token."""
    import torch

    from hybridmoe.engine.llm_engine import LLMEngine
    from hybridmoe.models.registry import load_config
    from hybridmoe.system.auto import resolve_engine_config
    from hybridmoe.weights.gguf_model_dir import resolve_model_path
    from hybridmoe.weights.loader import resolve_dtype

    t0 = time.perf_counter()
    engine = LLMEngine(model_dir, engine_config)
    load_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(workload.seed)
    prompts = torch.randint(0, engine.vocab_size, (workload.batch, workload.prompt_len), generator=g).tolist()
    _measure(engine, [prompts[0][:8]], 2)  # warm-up
    timings = _measure(engine, prompts, workload.gen_len)
    # the same resolution the loader made (it reads config.json only), for reporting what "auto" became
    resolved_dir = resolve_model_path(model_dir, engine.config)
    _, config = load_config(resolved_dir)
    resolved = resolve_engine_config(engine.config, config, resolve_dtype(engine.config.dtype, config), resolved_dir)
    setup = {"model": str(model_dir), "architecture": engine.model_config.get("architectures"),
             "dtype": str(engine.dtype).removeprefix("torch."), "prompt_len": workload.prompt_len,
             "gen_len": workload.gen_len, "batch": workload.batch, "engine": vars(engine.config),
             "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine()}
    return E2EResult(**timings, load_s=load_s,
                     peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # KiB on Linux
                     setup=setup, resolved=resolved, cuda_graph=engine.runner.cuda_graph)


def _measure(engine, prompts: list[list[int]], gen_len: int) -> dict:
    from hybridmoe.sampling_params import SamplingParams

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


@dataclass
class DepthInfo:
    """The full model a cut (fewer-layer) checkpoint stands for: extrapolation targets."""

    layers: int
    dense_layers: int
    moe_layers: int


@dataclass
class SuiteResult:
    """One engine configuration measured the way issue #4 asks (batch 1)."""

    label: str
    prefill_tok_s: dict[int, float]
    """Prompt length -> prompt tokens/s (one request, time to its first token)."""
    ttft_s: dict[int, float]
    decode_s: float
    """Seconds per decoded token (mean over gen_len - 1 steps after the first token)."""
    load_s: float
    peak_rss_gib: float
    peak_gpu_gib: float | None
    """torch.cuda.max_memory_allocated over load and every run; None on the CPU."""
    floor: object
    """bench_floor.DecodeFloor of the loaded placement, GPU share of the routing measured over the decode."""
    uniform_floor: object
    """The same with uniform routing (g/E of a token's experts on the GPU), for comparison."""
    layer_times: object | None
    """bench_layers.LayerTimes, when the run was asked to extrapolate."""
    depth: DepthInfo | None
    resolved: EngineConfig
    cuda_graph: bool

    @property
    def decode_tok_s(self) -> float:
        return 1.0 / self.decode_s

    def full_depth(self) -> dict | None:
        """Decode step and floor of the full-depth model (None unless this model was cut and timed per layer)."""
        lt, d = self.layer_times, self.depth
        if lt is None or d is None:
            return None
        step = lt.full_depth_s(self.decode_s, d.dense_layers, d.moe_layers)
        floor = self.floor.per_moe_layer_seconds() * d.moe_layers
        return {"layers": d.layers, "decode_s": step, "decode_tok_s": 1.0 / step, "floor_s": floor,
                "decode_over_floor": step / floor if floor > 0 else float("nan")}

    def to_json(self) -> dict:
        from hybridmoe.bench_floor import floor_ratio

        return {"label": self.label, "prefill_tok_s": self.prefill_tok_s, "ttft_s": self.ttft_s,
                "decode_tok_s": self.decode_tok_s, "decode_s": self.decode_s, "load_s": self.load_s,
                "peak_rss_gib": self.peak_rss_gib, "peak_gpu_gib": self.peak_gpu_gib,
                "floor": self.floor.to_json(), "decode_over_floor": floor_ratio(self.decode_s, self.floor),
                "uniform_routing_floor": self.uniform_floor.to_json(),
                "layer_times": self.layer_times.to_json() if self.layer_times is not None else None,
                "full_depth": self.full_depth(), "cuda_graph": self.cuda_graph,
                "engine": {k: v for k, v in vars(self.resolved).items()}}


def run_suite(label: str, model_dir: str, engine_config: EngineConfig, prompt_lens: list[int], gen_len: int,
              bandwidth: float, bandwidth_method: str, *, decode_prompt_len: int = 64, seed: int = 0,
              depth: DepthInfo | None = None) -> SuiteResult:
    """Load model_dir, then: prefill of one prompt per length in prompt_lens; decode of gen_len tokens after a
    decode_prompt_len prompt (run once untimed first, so every CUDA graph it needs is captured); with depth,
    an eager per-layer timing for the full-depth extrapolation. The engine is dropped before returning."""
    import gc

    import torch

    from hybridmoe.bench_floor import decode_floor, decode_routing
    from hybridmoe.bench_layers import measure_layer_times
    from hybridmoe.engine.llm_engine import LLMEngine

    if gen_len < 2:
        raise HybridMoEError(f"gen_len must be at least 2 to time decoding, got {gen_len}")
    cuda = torch.device(engine_config.device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    engine = LLMEngine(model_dir, engine_config)
    load_s = time.perf_counter() - t0
    try:
        g = torch.Generator().manual_seed(seed)

        def prompt(n: int) -> list[int]:
            return torch.randint(0, engine.vocab_size, (n,), generator=g).tolist()

        _measure(engine, [prompt(8)], 2)  # warm-up: lazy initialisation out of the numbers
        prefill, ttft = {}, {}
        for n in prompt_lens:
            timing = _measure(engine, [prompt(n)], 1)
            prefill[n], ttft[n] = timing["prefill_tok_s"], timing["ttft_mean_s"]
        decode_prompt = prompt(decode_prompt_len)
        _measure(engine, [decode_prompt], gen_len)  # captures the graphs these lengths replay
        timing = _measure(engine, [decode_prompt], gen_len)
        decode_s = 1.0 / timing["decode_tok_s"]
        layer_times = measure_layer_times(engine, decode_prompt, gen_len) if depth is not None else None
        routing = decode_routing(engine, decode_prompt, gen_len)
        floor = decode_floor(engine.runner.model, bandwidth, bandwidth_method, routing)
        uniform_floor = decode_floor(engine.runner.model, bandwidth, bandwidth_method)
        resolved = _resolved(engine)
        cuda_graph = engine.runner.cuda_graph
    finally:
        del engine
        gc.collect()
    peak_gpu = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    if cuda:
        torch.cuda.empty_cache()
    return SuiteResult(label, prefill, ttft, decode_s, load_s,
                       resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, peak_gpu, floor, uniform_floor,
                       layer_times, depth, resolved, cuda_graph)


def _resolved(engine) -> EngineConfig:
    """engine's options with "auto" resolved as the loader resolved them (it reads config.json only)."""
    from hybridmoe.models.registry import load_config
    from hybridmoe.system.auto import resolve_engine_config
    from hybridmoe.weights.loader import resolve_dtype

    _, config = load_config(engine.model_dir)
    return resolve_engine_config(engine.config, config, resolve_dtype(engine.config.dtype, config), engine.model_dir)
