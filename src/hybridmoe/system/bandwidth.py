"""Measured bandwidths: host memory read (what bounds CPU expert decode), host memory as torch's matrix-vector
products read it (the model's own layers on the CPU), GPU memory, and pinned host-to-GPU copies."""

from __future__ import annotations

import os
import statistics
import time

import torch

from hybridmoe.platform import native_engine_built


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def host_read_bandwidth(nbytes: int = 1 << 30, threads: int | None = None, repeats: int = 5) -> float:
    """Bytes/s read from host memory over an nbytes buffer on `threads` threads (default: every allowed CPU).

    With the native engine built: its own probe (csrc/runtime/read_bandwidth.h), the widest loads the
    CPU has on the engine's pinned pool, best of 3 rounds of the median of `repeats` passes; the
    engine's kernels read weights the same way, so their fraction of it stays at or below 1.
    Otherwise a float32 sum on torch threads (it reads slower than AVX-512 loads do)."""
    threads = threads or len(os.sched_getaffinity(0))
    if native_engine_built():
        from hybridmoe import _native

        return _native.read_bandwidth(nbytes, threads, passes=repeats)
    return torch_read_bandwidth(nbytes, threads, repeats)


def host_read_method() -> str:
    """How host_read_bandwidth measures here, for reports."""
    if native_engine_built():
        from hybridmoe import _native

        return f"native {_native.read_bandwidth_isa()} loads"
    return "float32 sum"


def floor_bandwidth(nbytes: int = 1 << 30, threads: int | None = None) -> float:
    """The read bandwidth a decode floor divides by: with the native engine the higher of its probe's plain
    loads (host_read_bandwidth) and the same probe with the decode kernels' software prefetches ahead of its
    loads, which can read faster (137 vs 127 GB/s) as the kernels do;
    a floor below what our own decode reaches is no floor. Otherwise host_read_bandwidth."""
    threads = threads or len(os.sched_getaffinity(0))
    plain = host_read_bandwidth(nbytes, threads)
    if not native_engine_built():
        return plain
    from hybridmoe import _native

    return max(plain, _native.read_bandwidth(nbytes, threads, prefetch=True))


def floor_bandwidth_method() -> str:
    """How floor_bandwidth measures here, for reports."""
    if native_engine_built():
        return f"{host_read_method()}, the higher of plain and prefetching"
    return host_read_method()


def torch_read_bandwidth(nbytes: int, threads: int, repeats: int = 5) -> float:
    """Bytes/s read by a float32 sum over nbytes on `threads` torch threads (the fallback probe)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(max(nbytes // 4, 1))
        buf.sum()  # pages touched, threads started
        seconds = _median_seconds(buf.sum, repeats)
    finally:
        torch.set_num_threads(previous)
    return buf.numel() * 4 / seconds


GEMV_COLUMNS = 4096
"""In-features of the weight torch_gemv_bandwidth reads: a model's widest projections have about as many."""


def torch_gemv_bandwidth(nbytes: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """Bytes/s of weight read by torch's matrix-vector product (x [1, GEMV_COLUMNS] @ W.T) over a dtype weight
    of nbytes, on torch's threads: how fast a decode step reads the weights torch runs on the CPU (attention,
    dense layers, the output head), which it does slower than the native engine's loads."""
    rows = max(nbytes // (GEMV_COLUMNS * dtype.itemsize), 1)
    weight = torch.ones(rows, GEMV_COLUMNS, dtype=dtype)
    x = torch.ones(1, GEMV_COLUMNS, dtype=dtype)
    torch.nn.functional.linear(x, weight)  # pages touched, threads started
    seconds = _median_seconds(lambda: torch.nn.functional.linear(x, weight), repeats)
    return weight.numel() * dtype.itemsize / seconds


def device_copy_bandwidth(device: str | torch.device = "cuda", nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes/s through GPU memory of a device-to-device copy of nbytes, its read and its write both counted
    (synchronized per copy): a conservative figure for how fast the GPU reads its weights."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)

    def copy():
        dst.copy_(src)
        torch.cuda.synchronize(device)

    copy()
    return 2 * nbytes / _median_seconds(copy, repeats)


def pinned_h2d_bandwidth(device: str | torch.device = "cuda", nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes/s of an async copy from pinned host memory to the GPU (synchronized per copy)."""
    src = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy():
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)

    copy()
    return nbytes / _median_seconds(copy, repeats)
