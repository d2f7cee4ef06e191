"""How `peers.py kt` times one layer's calls, the same for kt-kernel and for ours.

Decode sizes (T <= DECODE_MAX_T) run as in a model's decode: calls back to back, each one's experts not in the
caches. The experts are split into disjoint windows of T x K (at least two windows), and call r routes every token
to K distinct experts of window r mod the window count, so no call finds the previous one's weights in the
caches, and neither system's worker threads fall asleep between calls (a cache flush between calls would leave
them idle for tens of milliseconds, which no decode does). With fewer experts than two windows hold, the caches
are flushed before each call instead. Prefill sizes (T > DECODE_MAX_T) touch every expert: one routing, called
repeatedly.
"""

from __future__ import annotations

import statistics
import time

import torch

from .common import cache_flusher
from .moe_layer import DECODE_MAX_T, median_ms, routing


def windowed_routings(T: int, H: int, E: int, K: int, seed: int) -> list[tuple] | None:
    """One routing per expert window (x bf16 [T, H], ids int32 [T, K], w float32 [T, K]), or None when E holds
    fewer than two windows of T x K experts."""
    width = T * K
    count = E // width
    if count < 2:
        return None
    g = torch.Generator().manual_seed(seed)
    calls = []
    for r in range(count):
        base = r * (E // count)
        ids = torch.stack([base + torch.randperm(E // count, generator=g)[:K] for _ in range(T)]).int()
        w = torch.softmax(torch.randn(T, K, generator=g), -1)
        calls.append((torch.randn(T, H, generator=g).bfloat16(), ids, w))
    return calls


def distinct_experts(calls: list[tuple]) -> float:
    """Mean distinct experts per call (what the floor counts)."""
    return statistics.fmean(len(torch.unique(ids)) for _, ids, _ in calls)


def timed_ms(call, T: int, H: int, E: int, K: int, reps: int, budget_s: float) -> tuple[float, float]:
    """Median ms of call(x, ids, w) at T tokens and the mean distinct experts per timed call."""
    stream = windowed_routings(T, H, E, K, seed=T) if T <= DECODE_MAX_T else None
    if stream is None:
        x, ids, w = routing(T, H, E, K, seed=T)
        flush = cache_flusher("write") if T <= DECODE_MAX_T else None
        return median_ms(lambda: call(x, ids, w), reps, flush, budget_s=budget_s), float(len(torch.unique(ids)))
    for args in stream:  # one pass untimed: first-touch of every window's buffers
        call(*args)
    times, start = [], time.perf_counter()
    while len(times) < max(reps, len(stream)) and (time.perf_counter() - start < budget_s or len(times) < 3):
        args = stream[len(times) % len(stream)]
        t0 = time.perf_counter()
        call(*args)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), distinct_experts(stream)
