"""What several benchmarks share: the layer shapes, the host read probes, cache flushing and busy waits,
CUDA graph capture and timing, and a greedy decode timed per token."""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from hybridmoe.platform import native_engine_built
from hybridmoe.sampling_params import SamplingParams
from hybridmoe.system.bandwidth import host_read_bandwidth

SHAPES = {  # hidden H, expert intermediate I, experts E, experts per token K
    "qwen3-30b-a3b": dict(H=2048, I=768, E=128, K=8),
    "deepseek-v3": dict(H=7168, I=2048, E=256, K=8),
    "mixtral-8x7b": dict(H=4096, I=14336, E=8, K=2),
    "gpt-oss-120b": dict(H=2880, I=2880, E=128, K=4),
}


def layer_shape(name: str, experts: int | None = None, top_k: int | None = None) -> dict:
    """SHAPES[name], with E and K overridden where given (--experts, --top-k)."""
    shape = dict(SHAPES[name])
    if experts:
        shape["E"] = experts
    if top_k:
        shape["K"] = top_k
    return shape


def host_read_gbps(threads: int) -> float:
    """GB/s read over 2 GiB on `threads` threads: hybridmoe.system.bandwidth's probe (the native one when built)."""
    return host_read_bandwidth(2 << 30, threads) / 1e9


def prefetching_read_gbps(threads: int) -> float:
    """GB/s of the native probe with the decode kernels' software prefetches ahead of its loads
    (more bytes in flight per core than plain loads: it can read faster); nan without the extension."""
    if not native_engine_built():
        return float("nan")
    from hybridmoe import _native

    return _native.read_bandwidth(2 << 30, threads, prefetch=True) / 1e9


def busy_wait(seconds: float) -> None:
    """Spin on this thread for `seconds` (what a step's GPU work leaves the calling thread)."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass


def cache_flusher(kind: str = "write"):
    """A function that evicts every cache level from this thread alone (numpy: torch's OpenMP workers, which
    would busy-wait on the cores the engine's workers are pinned to, stay asleep). "write" adds 1 to a
    256 MiB buffer and leaves the caches full of dirty lines, which the next call's reads must write back
    first; "read" sums 768 MiB and leaves them clean (closer to a model, whose other layers' weights are
    what the caches hold between two calls of one layer)."""
    if kind == "write":
        buf = np.zeros(256 * 1024 * 1024, dtype=np.uint8)
        return lambda: np.add(buf, 1, out=buf)
    buf = np.ones(768 * 1024 * 1024 // 8, dtype=np.uint64)
    return lambda: buf.sum()


def capture_graph(fn, keep_graph: bool = False) -> torch.cuda.CUDAGraph:
    """fn() captured as a CUDA graph after one warm-up call on a side stream; keep_graph keeps its
    cudaGraph_t (for reading its nodes)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph(keep_graph=keep_graph) if keep_graph else torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, reps: int, warmup: int = 5) -> float:
    """Median microseconds of one replay (CUDA events around each), after `warmup` untimed replays."""
    for _ in range(warmup):
        graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def seconds_per_call(fn, reps: int, trials: int, warmup: int = 3, blocking: bool = False) -> float:
    """Median over `trials` of the seconds per call of `reps` calls of fn in a row, the GPU synchronized
    after each trial, after `warmup` calls. blocking: this thread sleeps while it waits for the GPU (an
    event with blocking sync) instead of spinning in torch.cuda.synchronize, leaving its core free."""

    def sync():
        if blocking:
            done = torch.cuda.Event(blocking=True)
            done.record()
            done.synchronize()
        else:
            torch.cuda.synchronize()

    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        samples.append((time.perf_counter() - t0) / reps)
    return statistics.median(samples)


def decode_seconds(engine, prompt: list[int], gen_len: int) -> tuple[float, list[int]]:
    """Seconds per decoded token (the prompt's step left out) and the tokens, greedy, batch 1, EOS ignored."""
    engine.add_request(prompt, SamplingParams(max_tokens=gen_len, temperature=0, ignore_eos=True))
    tokens: list[int] = []
    first = None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
        if first is None:
            first = time.perf_counter()
    return (time.perf_counter() - first) / (len(tokens) - 1), tokens
