"""One loaded engine measured the way issue #4 reports it, at batch 1 (`benchmarks/e2e.py` prints the tables).

Per engine: prefill tok/s and time to first token of one prompt per length; decode seconds per token
(gen_len tokens after a short prompt, run once untimed first so every CUDA graph it replays is
captured); the decode floor of the loaded placement (floor.py, with the routing measured over
the same decode); peak GPU memory and RSS; with a DepthInfo, per-layer times for the full-depth
extrapolation (layers.py); on the CUDA handoff's stream_mem_ops path, where the decode step's time
goes (anatomy.py). Optionally the same engine again with CUDA graphs off (the runner then runs the
same fixed shapes eagerly, which is what --no-cuda-graph loads), and with graphs on again and options of
the stream_mem_ops handoffs changed (HANDOFF_OPTIONS: zero-copy staging, one token's padding slots left
out; the graphs captured anew). With repeats, every row of the
engine is measured that many times, the rows interleaved, and reports the median and the samples.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
import traceback
from dataclasses import dataclass, field, replace

import torch

from hybridmoe.bench.anatomy import StepAnatomy, step_anatomy
from hybridmoe.bench.e2e import _measure, peak_rss_gib
from hybridmoe.bench.floor import DecodeFloor, decode_floor, decode_routing, floor_ratio
from hybridmoe.bench.layers import (
    LayerTimes,
    measure_layer_times,
    measure_prefill_layer_times,
)
from hybridmoe.config import EngineConfig
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.errors import HybridMoEError

HANDOFF_OPTIONS = ("zero_copy", "trim_padding")
"""CudaHandoff attributes a variant may set (cuda_handoff.py); the others keep the engine's own values."""
EXPERT_OPTIONS = ("pin_decode_thread", "help_decode_wait", "prefetch_next")
"""HybridTuning attributes (HybridExperts.tuning) a variant may set the same way, reported with the handoff options."""
RUNNER_OPTIONS = ("sample_on_device", "lookahead")
"""ModelRunner attributes a variant may set the same way (model_runner.py: the decode step's host path)."""


@dataclass
class DepthInfo:
    """The full model a cut (fewer-layer) checkpoint stands for: extrapolation targets."""

    layers: int
    dense_layers: int
    moe_layers: int


@dataclass
class SuiteResult:
    label: str
    prefill_tok_s: dict[int, float]
    """Prompt length -> prompt tokens/s (one request, time to its first token)."""
    ttft_s: dict[int, float]
    decode_s: float
    """Seconds per decoded token (mean over the gen_len - 1 steps after the first token; a sample's is the
    median of its decode_runs runs, the result the median of the samples')."""
    load_s: float
    rss_gib: float
    """Resident memory once loaded and warmed up."""
    peak_rss_gib: float
    """The process's peak so far (loading included: source and packed experts at once)."""
    peak_gpu_gib: float | None
    """torch.cuda.max_memory_allocated over this engine's load and runs; None on the CPU."""
    floor: DecodeFloor
    """The loaded placement's floor, with the GPU share of the routing measured over the decode."""
    uniform_floor: DecodeFloor
    """The same with uniform routing (g/E of a token's experts on the GPU), for comparison."""
    layer_times: LayerTimes | None
    depth: DepthInfo | None
    resolved: EngineConfig
    cuda_graph: bool
    model_layers: int
    """Decoder layers of the model measured (the cut model's when cut)."""
    anatomy: StepAnatomy | None = None
    """Where the decode step's time went (stream_mem_ops handoff only)."""
    handoff_options: dict | None = None
    """The stream_mem_ops handoffs' HANDOFF_OPTIONS, the hybrid experts' EXPERT_OPTIONS and the runner's
    RUNNER_OPTIONS in this run, None without such a handoff."""
    prefill_layer_times: dict[int, LayerTimes] = field(default_factory=dict)
    """Prompt length -> its prefill timed per layer (a cut model's first sample), for full_depth."""
    decode_samples_s: list[float] = field(default_factory=list)
    """decode_s of each repeat, in the order measured."""
    prefill_samples: dict[int, list[float]] = field(default_factory=dict)
    """Prompt length -> prefill tok/s of each repeat."""

    @property
    def decode_spread(self) -> float:
        """(slowest - fastest) / median decode time over the repeats (0 with one)."""
        d = self.decode_samples_s
        return (max(d) - min(d)) / self.decode_s if d else 0.0

    @property
    def decode_tok_s(self) -> float:
        return 1.0 / self.decode_s

    def full_depth(self) -> dict | None:
        """Decode step, floor and prefill rates of the full-depth model (None unless this model was cut and
        timed per layer); a prefill timed per layer extrapolates by layer kind, else as if layers were alike."""
        lt, d = self.layer_times, self.depth
        if lt is None or d is None:
            return None
        step = lt.full_depth_s(self.decode_s, d.dense_layers, d.moe_layers)
        floor = self.floor.per_moe_layer_seconds() * d.moe_layers
        prefill = {n: n / self.prefill_layer_times[n].full_depth_s(self.ttft_s[n], d.dense_layers, d.moe_layers)
                   if n in self.prefill_layer_times else v * len(lt.layer_s) / d.layers  # (else layers alike)
                   for n, v in self.prefill_tok_s.items()}
        return {"layers": d.layers, "decode_s": step, "decode_tok_s": 1.0 / step, "floor_s": floor,
                "decode_over_floor": step / floor if floor > 0 else float("nan"), "prefill_tok_s": prefill}

    def to_json(self) -> dict:
        return {"label": self.label, "prefill_tok_s": self.prefill_tok_s, "ttft_s": self.ttft_s,
                "decode_tok_s": self.decode_tok_s, "decode_s": self.decode_s, "load_s": self.load_s,
                "rss_gib": self.rss_gib, "peak_rss_gib": self.peak_rss_gib, "peak_gpu_gib": self.peak_gpu_gib,
                "floor": self.floor.to_json(), "decode_over_floor": floor_ratio(self.decode_s, self.floor),
                "uniform_routing_floor": self.uniform_floor.to_json(),
                "layer_times": self.layer_times.to_json() if self.layer_times is not None else None,
                "prefill_layer_times": {n: lt.to_json() for n, lt in self.prefill_layer_times.items()},
                "full_depth": self.full_depth(), "cuda_graph": self.cuda_graph, "engine": vars(self.resolved),
                "model_layers": self.model_layers, "handoff_options": self.handoff_options,
                "anatomy": self.anatomy.to_json() if self.anatomy is not None else None,
                "decode_samples_s": self.decode_samples_s, "prefill_samples": self.prefill_samples}


@dataclass(frozen=True)
class Row:
    """One row measured on a loaded engine."""

    label: str
    graph: bool
    """CUDA graphs on (as the engine loaded) or off."""
    options: dict | None
    """HANDOFF_OPTIONS set on the stream_mem_ops handoffs (EXPERT_OPTIONS on the hybrid experts, RUNNER_OPTIONS on
    the model runner), over the engine's own (None: its own)."""
    every_length: bool
    """Prefill every prompt length (else the first only)."""
    deferred: int | None = None
    """Deferred experts switched to on the engine (HybridExperts.set_deferred_experts; None: its own)."""

    @property
    def variant(self) -> bool:
        """A row that changes the engine's handoffs (options or deferral): its failure loses only itself."""
        return self.options is not None or self.deferred is not None


def run_suite(label: str, model_dir: str, engine_config: EngineConfig, prompt_lens: list[int], gen_len: int,
              bandwidth: float, bandwidth_method: str, *, decode_prompt_len: int = 64, seed: int = 0,
              depth: DepthInfo | None = None, eager_label: str | None = None,
              handoff_variants: tuple[tuple[str, dict], ...] = (),
              deferral_variants: tuple[tuple[str, int], ...] = (), repeats: int = 1,
              decode_runs: int = 1) -> list[SuiteResult]:
    """Load model_dir with engine_config and measure it; with eager_label, measure the same engine again
    with CUDA graphs off (prefill at prompt_lens[0] only) as a further result; for each (label, K) of
    deferral_variants, again with K deferred experts (HybridExperts.set_deferred_experts, the graphs
    captured anew); for each (label, options) of handoff_variants, again with graphs on and those
    HANDOFF_OPTIONS set on the stream_mem_ops handoffs (EXPERT_OPTIONS on the hybrid experts; either only
    when the model has such handoffs). The rows after the
    first prefill prompt_lens[0] only; a variant row that fails is reported and dropped. With repeats N,
    the rows are measured N times interleaved, each round starting one row later (A B C, B C A, C A B ...),
    so that a drift of the host, or a slow first row after a switch, shows in every row's spread instead
    of between rows; each result holds its N samples and reports their
    median. An interruption (a BaseException that is no Exception, e.g. the caller's SIGTERM)
    once a row has a sample is raised again with the results so far as its `results` (the rounds every
    row completed; in the first round, the rows done). The engine is dropped after."""
    if gen_len < 2:
        raise HybridMoEError(f"gen_len must be at least 2 to time decoding, got {gen_len}")
    if repeats < 1:
        raise HybridMoEError(f"repeats must be at least 1, got {repeats}")
    if decode_runs < 1:
        raise HybridMoEError(f"decode_runs must be at least 1, got {decode_runs}")
    cuda = torch.device(engine_config.device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    # every repetition prefills the same prompts into an empty context (llama-bench's pp<N>): a prefix cache
    # would serve the repetitions after the first from the blocks the first one left
    engine = LLMEngine(model_dir, replace(engine_config, prefix_caching=False))
    load_s = time.perf_counter() - t0
    bench = None
    try:
        g = torch.Generator().manual_seed(seed)

        def prompt(n: int) -> list[int]:
            return torch.randint(0, engine.vocab_size, (n,), generator=g).tolist()

        # warm-up: lazy initialisation (allocator, kernel choices, pool wake-up) of every prefill step shape
        # measured below (longer prompts run in chunks of max_num_batched_tokens) kept out of the numbers
        for n in sorted({min(n, engine.config.max_num_batched_tokens) for n in prompt_lens}):
            _measure(engine, [prompt(n)], 1)  # the prompt only: decode graphs are captured below
        bench = _Bench(engine, prompt(decode_prompt_len), gen_len, bandwidth, bandwidth_method, depth is not None,
                       decode_runs)
        rows = [Row(label, bench.graphs, None, True)]
        if eager_label is not None:
            rows.append(Row(eager_label, False, None, False))
        rows += [Row(variant, bench.graphs, None, False, deferred=k) for variant, k in deferral_variants]
        for variant, options in handoff_variants if bench.memops else ():
            variant, options = toggled(variant, options, bench.defaults)
            rows.append(Row(variant, bench.graphs, options, False))
        prompts = {row.label: {n: prompt(n) for n in (prompt_lens if row.every_length else prompt_lens[:1])}
                   for row in rows}
        samples: dict[str, list[Sample]] = {row.label: [] for row in rows}
        stopped = None
        for rep in range(repeats):
            try:
                live = [r for r in rows if r.label in samples]
                # each round starts one row later: no row is always the first after a switch (the row right
                # after a change can run slow: docs/decisions.md, "Rows interleaved")
                for row in live[rep % len(live):] + live[:rep % len(live)]:
                    bench.measure(row, prompts[row.label], samples, first=rep == 0)
            except Exception:
                raise
            except BaseException as e:  # noqa: BLE001 (raised again below, with the rows measured so far)
                stopped = e
                break
        rounds = max(1, min(map(len, samples.values())))  # complete rounds (or the first one's rows done)
        samples = {label: got[:rounds] for label, got in samples.items() if len(got) >= rounds}
        if stopped is not None and not samples:
            raise stopped
        engine.runner.cuda_graph = bench.graphs
        common = dict(load_s=load_s, depth=depth, resolved=engine.resolved_config, rss_gib=_rss_gib(),
                      peak_rss_gib=peak_rss_gib(),
                      peak_gpu_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                      model_layers=len(engine.runner.model.model.layers))
        results = [_result(row, samples[row.label], bench.options(row), **common)
                   for row in rows if row.label in samples]
    finally:
        del engine, bench
        gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    if stopped is not None:
        stopped.results = results
        raise stopped
    return results


class _Bench:
    """A loaded engine switched between rows (graphs on or off, handoff options) and measured."""

    def __init__(self, engine, decode_prompt: list[int], gen_len: int, bandwidth: float, bandwidth_method: str,
                 layer_times: bool, decode_runs: int = 1):
        self.engine, self.decode_prompt, self.gen_len, self.decode_runs = engine, decode_prompt, gen_len, decode_runs
        self.bandwidth, self.bandwidth_method, self.layer_times = bandwidth, bandwidth_method, layer_times
        self.memops = self._memops()
        experts = engine.runner.model.experts
        self.defaults = ({**{name: getattr(self.memops[0], name) for name in HANDOFF_OPTIONS},
                          **{name: getattr(experts.tuning, name) for name in EXPERT_OPTIONS},
                          **{name: getattr(engine.runner, name) for name in RUNNER_OPTIONS}} if self.memops else None)
        self.graphs = engine.runner.cuda_graph
        self.captured = self.defaults  # the options the engine's graphs were captured with
        self.retired = []  # graphs captured with other options: kept alive, as their memory pool is reused
        self.own_deferred = self.deferred = engine.resolved_config.deferred_experts

    def _memops(self) -> list:
        return [h for h in handoffs(self.engine.runner.model) if h.path == "stream_mem_ops"]

    def options(self, row: Row) -> dict | None:
        return {**self.defaults, **(row.options or {})} if self.memops else None

    def measure(self, row: Row, prompts: dict[int, list[int]], samples: dict[str, list], first: bool) -> None:
        """Set the engine up as `row` says and append one Sample to samples[row.label]; a variant row that
        fails is reported and its label dropped from samples."""
        try:
            self._set_up(row)
            samples[row.label].append(_sample(self.engine, prompts, self.decode_prompt, self.gen_len, self.decode_runs,
                                              first=first, layer_times=self.layer_times, bandwidth=self.bandwidth,
                                              bandwidth_method=self.bandwidth_method))
        except Exception as e:  # noqa: BLE001 (a variant's crash must not lose the rows measured)
            if not row.variant:
                raise
            traceback.print_exc()
            print(f"  {row.label}: FAILED ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})", flush=True)
            del samples[row.label]

    def _set_up(self, row: Row) -> None:
        runner = self.engine.runner
        deferred = self.own_deferred if row.deferred is None else row.deferred
        if deferred != self.deferred:  # new handoffs: the graphs of the old ones are never replayed again
            if torch.device(self.engine.config.device).type == "cuda":
                torch.cuda.synchronize()  # nothing in flight on the old handoffs
            if self.graphs:
                self.retired += runner._graphs.values()
                runner._graphs.clear()
            self.captured = None
            self.deferred = deferred
            runner.model.experts.set_deferred_experts(deferred)
            self.memops = self._memops()
        options = self.options(row)
        for name, value in (options or {}).items():  # None: no stream_mem_ops handoff, nothing to set
            targets = ([runner.model.experts.tuning] if name in EXPERT_OPTIONS else [runner] if name in RUNNER_OPTIONS
                       else self.memops)
            for target in targets:
                setattr(target, name, value)
        if self.graphs and options != self.captured:
            self.retired += runner._graphs.values()
            runner._graphs.clear()  # capture them again with these options
            self.captured = options
        runner.cuda_graph = row.graph


def toggled(label: str, options: dict, defaults: dict) -> tuple[str, dict]:
    """A handoff row that would set only what the engine already has (e.g. trim_padding, on by default)
    measures the other way instead: the options negated, " off" after its label."""
    if options and all(defaults.get(name) == value for name, value in options.items()):
        return f"{label} off", {name: not value for name, value in options.items()}
    return label, options


def handoffs(model) -> list:
    """The CUDA handoffs of a model's hybrid experts (fixed-shape steps on CUDA), each once; [] if none."""
    found = getattr(model.experts, "_handoffs", {})  # HybridExperts: (deferred?, layer) -> (handoff, width)
    return list({id(h): h for h, _ in found.values()}.values())


@dataclass
class Sample:
    """One measurement of a row: what _sample times every time, and what it measures the first time only."""

    prefill_tok_s: dict[int, float]
    ttft_s: dict[int, float]
    decode_s: float
    anatomy: StepAnatomy | None
    layer_times: LayerTimes | None = None
    prefill_layer_times: dict[int, LayerTimes] = field(default_factory=dict)
    floor: DecodeFloor | None = None
    uniform_floor: DecodeFloor | None = None


def _sample(engine, prompts: dict[int, list[int]], decode_prompt: list[int], gen_len: int, decode_runs: int, *,
            first: bool, layer_times: bool, bandwidth: float, bandwidth_method: str) -> Sample:
    """Each prompt's prefill, then gen_len decoded tokens (once untimed first: it captures the graphs these
    lengths replay; then decode_runs times, the sample their median); on the first sample of a row also the
    per-layer times (when asked) and the floor."""
    prefill, ttft = {}, {}
    for n, p in prompts.items():
        timing = _measure(engine, [p], 1)
        prefill[n], ttft[n] = timing["prefill_tok_s"], timing["ttft_mean_s"]
    _measure(engine, [decode_prompt], gen_len)
    hs = handoffs(engine.runner.model)
    for h in hs:
        h.take_stats()
    runs = [1.0 / _measure(engine, [decode_prompt], gen_len)["decode_tok_s"] for _ in range(decode_runs)]
    # the handoffs' counts span every run: their mean step goes with them
    anatomy = step_anatomy([h.take_stats() for h in hs], statistics.fmean(runs))
    sample = Sample(prefill, ttft, statistics.median(runs), anatomy)
    if first:
        model = engine.runner.model
        if layer_times:
            sample.layer_times = measure_layer_times(engine, decode_prompt, gen_len)
            sample.prefill_layer_times = {n: measure_prefill_layer_times(engine, p) for n, p in prompts.items()}
        sample.floor = decode_floor(model, bandwidth, bandwidth_method, decode_routing(engine, decode_prompt, gen_len))
        sample.uniform_floor = decode_floor(model, bandwidth, bandwidth_method)
    return sample


def _result(row: Row, samples: list[Sample], handoff_options: dict | None, resolved: EngineConfig,
            **common) -> SuiteResult:
    """A row's SuiteResult: the median of its samples (the anatomy of the sample with the median decode)."""
    decode = [s.decode_s for s in samples]
    median_sample = sorted(samples, key=lambda s: s.decode_s)[(len(samples) - 1) // 2]
    lens = samples[0].prefill_tok_s
    if not row.graph:
        resolved = replace(resolved, cuda_graph=False)
    if row.deferred is not None:
        resolved = replace(resolved, deferred_experts=row.deferred)
    return SuiteResult(row.label, {n: statistics.median(s.prefill_tok_s[n] for s in samples) for n in lens},
                       {n: statistics.median(s.ttft_s[n] for s in samples) for n in lens},
                       statistics.median(decode), floor=samples[0].floor, uniform_floor=samples[0].uniform_floor,
                       layer_times=samples[0].layer_times, prefill_layer_times=samples[0].prefill_layer_times,
                       cuda_graph=row.graph, anatomy=median_sample.anatomy,
                       decode_samples_s=decode,
                       prefill_samples={n: [s.prefill_tok_s[n] for s in samples] for n in lens},
                       resolved=resolved,
                       handoff_options=handoff_options, **common)


def _rss_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
