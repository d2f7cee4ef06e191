"""CPU expert layers ordered on a CUDA stream with no Python on the way: the CPU/GPU handoff.

T tokens, K experts per token, H hidden. For one layer whose routed experts run on the CPU:

    handoff = CudaHandoff({layer: cpu_experts, ...}, max_tokens=8, top_k=K)
    out = handoff.enqueue(stream, layer, hidden, topk_ids, topk_weights)   # all on `stream`:
        D2H   hidden [T, H], topk_ids [T, K], topk_weights [T, K] -> pinned staging buffers
        CPU   the native engine runs the layer on the staged rows
        H2D   staged output [T, H] -> out (on the GPU, hidden's dtype)

or split, so GPU work enqueued in between (shared experts, GPU-resident experts) overlaps the
CPU's: enqueue_submit(stream, layer, ...) ... enqueue_wait(stream, layer) -> out.

How the stream hands the rows to the CPU and gets the result back (`path`, C++ in
csrc/runtime/cuda_handoff.cpp and csrc/runtime/cuda_host.cpp):

  stream_mem_ops  after the D2H copies the stream clears the layer's done word and writes its
                  go word (T) in pinned, device-mapped host memory (cuStreamWriteValue32,
                  libcuda via dlopen); one native thread of the process spins on such words,
                  runs the layer on its own thread (as a worker of the engine's pool) and sets
                  the done word; the stream waits for it (cuStreamWaitValue32) and copies the
                  output H2D.
  host_function   the CPU work as native host functions (cudaLaunchHostFunc): submit and wait
                  run by CUDA's callback thread in stream order.

How the rows and the output cross: three D2H copies and one H2D copy, each a copy-engine operation
of a few µs; or (`zero_copy`, off by default) one kernel writes hidden, ids and weights straight into
the pinned buffers through the device's mapping of them, and the output is handed back as the mapping
of its buffer (the next kernel reads it over PCIe). With zero_copy a kernel of the caller's can also
write the rows itself (`staging`, enqueue_submit(staged=True)) and, on the stream_mem_ops path, play the
stream's part of the flags (`flag_words`: clear done, fence, go = T; enqueue_submit(signaled=True)) and
wait for done in the kernel that reads the output (enqueue_wait(in_kernel=True)): no stream memory
operation at all (HybridTuning.kernel_flags, experts/decode_fused_triton.py).

"auto" takes stream_mem_ops when a probe at construction shows the device waits on host
memory and replays a captured graph of such operations, else host_function; a log line says
which. Neither path takes the GIL. All of it is capturable: inside torch.cuda.graph(...) the
copies and the flag operations (or host functions) become nodes of the graph and run on every
replay. Staging buffers, flag words and the per-(layer, T) argument packs keep their addresses
for this object's lifetime: keep it alive as long as any graph captured with it, and as long
as work it enqueued may still run (with stream_mem_ops the stream would wait forever for a
layer nobody serves). Arguments are checked here, at enqueue time; CPU work that fails (an
expert id out of range) zeroes that layer's output and records the error, which check() raises.

stream_mem_ops is the default where it runs: per layer beyond the copies and the CPU work it costs
less than half of what a host function does (docs/decisions.md has the figures). tune() sets the
native engines' schedule knobs (hybridmoe.experts.tuning) for every layer.
"""

from __future__ import annotations

import glob
import importlib.util
import logging
import os
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from types import SimpleNamespace

import torch

from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.cpu_experts import _INT32_MAX, CpuExperts, _int_arg, _native
from hybridmoe.experts.tuning import EngineTuning, from_native, to_native

log = logging.getLogger("hybridmoe.experts")

PATHS = ("auto", "stream_mem_ops", "host_function")
_HIDDEN_DTYPES = (torch.bfloat16, torch.float32)
_IDS_DTYPES = (torch.int32, torch.int64)
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def cudart_candidates() -> list[str]:
    """Where the CUDA runtime torch uses lives: the libcudart mapped in this process, then the
    ones shipped beside torch (torch/lib, nvidia/cu*/lib, nvidia/cuda_runtime/lib)."""
    found = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                if "/libcudart" in path and path not in found:
                    found.append(path)
    except OSError:
        pass
    torch_dir = os.path.dirname(torch.__file__)
    site = os.path.dirname(torch_dir)
    for d in [os.path.join(torch_dir, "lib"), *sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib")))]:
        for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
            path = os.path.join(d, name)
            if os.path.exists(path) and path not in found:
                found.append(path)
    return found


def handoff_threads(threads: int, cpus: int) -> int:
    """Workers for the layers run through the handoff: the CPU experts' own count, but at most
    one fewer than the CPUs, so that the thread driving the GPU (which spins in CUDA's waits) has
    a CPU of its own. With every CPU taken by a pinned worker, that thread preempts one of them
    for a time slice and the whole layer waits (16 CPUs, toy layer: 50.7 µs per layer with 16
    workers, 31.0 µs with 15). That thread adds its CPU to the pool instead while it waits for its
    step (HybridExperts.wait_step, CudaHandoff.help_until), so nothing is preempted."""
    return max(1, min(threads, cpus - 1))


def driver_cpus(threads: int, numa_nodes: int, allowed: Sequence[int]) -> set[int]:
    """The CPUs a handoff pool of `threads` (handoff_threads) leaves to the thread that drives the GPU,
    among `allowed` (that thread's affinity when the pool was made): the native pool of one group pins
    its threads to the first `threads` allowed CPUs (thread_pool.cpp, shared_pool), the rest are free.
    Empty when none is, or with several NUMA groups (their CPUs come per node)."""
    allowed = sorted(allowed)
    if numa_nodes != 1 or threads >= len(allowed):
        return set()
    return set(allowed[threads:])


@contextmanager
def pinned(cpus: set[int]):
    """The calling thread on `cpus` inside the block, on its own affinity again after it; nothing
    changes with no cpus. For a decode step's driving thread: unpinned, the scheduler may leave it on
    the CPU of the pool's driver (which the handoff's polling thread runs the layers on), where it
    spins in CUDA's wait while the layers' gos wait for a time slice (unpinned steps saw gos up to
    3.8 ms late). Only around the step, so that a pool made later (another engine in the process)
    still sees every CPU."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def load_cuda_runtime() -> str:
    """Load libcudart for the native host functions (once); returns the path or name loaded."""
    try:
        return _native().load_cuda_runtime(cudart_candidates())
    except RuntimeError as e:
        raise HybridMoEError(f"{e}\nthe CUDA handoff needs the CUDA runtime torch uses; "
                             "run without CUDA graphs (--no-cuda-graph) or install torch with CUDA") from None


class _Staging:
    """One layer's pinned buffers: hidden, output [max_tokens, H]; ids, weights [max_tokens, K]; and
    (zero_copy) the same memory as the GPU sees it."""

    def __init__(self, max_tokens: int, H: int, K: int, dtype: torch.dtype, ids_dtype: torch.dtype):
        self.x = torch.zeros(max_tokens, H, dtype=dtype, pin_memory=True)
        self.ids = torch.zeros(max_tokens, K, dtype=ids_dtype, pin_memory=True)
        self.weights = torch.zeros(max_tokens, K, dtype=torch.float32, pin_memory=True)
        self.out = torch.zeros(max_tokens, H, dtype=dtype, pin_memory=True)
        self.mapped: SimpleNamespace | None = None  # x, ids, weights, out as CUDA tensors

    def map(self, device: torch.device) -> None:
        from hybridmoe.experts.mapped_staging import device_view

        self.mapped = SimpleNamespace(**{name: device_view(getattr(self, name), device)
                                         for name in ("x", "ids", "weights", "out")})


class CudaHandoff:
    """Native CPU/GPU handoff for the CPU-resident routed experts of several layers.

    experts: {layer: CpuExperts} (or a sequence, layers 0..n-1). max_tokens: the most tokens one
    call carries (the largest batch a graph is captured for). top_k: K, columns of topk_ids.
    dtype: the hidden states' dtype (bfloat16 or float32). device: the CUDA device (default:
    the current one). path: "auto", "stream_mem_ops" or "host_function" (see the module's doc).
    """

    def __init__(self, experts: Mapping[int, CpuExperts] | Sequence[CpuExperts], max_tokens: int, top_k: int,
                 dtype: torch.dtype = torch.bfloat16, ids_dtype: torch.dtype = torch.int64,
                 device: torch.device | str | None = None, path: str = "auto"):
        if not torch.cuda.is_available():
            raise HybridMoEError("the CUDA handoff needs a CUDA GPU, and torch sees none "
                                 "(torch.cuda.is_available() is False); run the experts without it")
        if dtype not in _HIDDEN_DTYPES:
            raise HybridMoEError(f"dtype must be torch.bfloat16 or torch.float32, got {dtype}")
        if path not in PATHS:
            raise HybridMoEError(f"path must be one of {', '.join(PATHS)}, got {path!r}")
        if ids_dtype not in _IDS_DTYPES:
            raise HybridMoEError(f"ids_dtype must be torch.int32 or torch.int64, got {ids_dtype}")
        # in layer order: the native side numbers them so, and its stats take a step to serve them in
        # increasing order (a model runs its layers so, whatever order they were loaded in)
        experts = dict(sorted(experts.items())) if isinstance(experts, Mapping) else dict(enumerate(experts))
        if not experts:
            raise HybridMoEError("the CUDA handoff needs at least one layer of CPU experts")
        for layer, ex in experts.items():
            if not isinstance(ex, CpuExperts):
                raise HybridMoEError(f"layer {layer}: the CUDA handoff runs the native CpuExperts only, "
                                     f"got {type(ex).__name__}")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if self.device.type != "cuda":
            raise HybridMoEError(f"device must be a CUDA device, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.runtime = load_cuda_runtime()
        self.dtype = dtype
        self.max_tokens = _int_arg("max_tokens", max_tokens, 1, _INT32_MAX)
        self.top_k = _int_arg("top_k", top_k, 1, _INT32_MAX)
        self._zero_copy = False
        self._flags_mapped: torch.Tensor | None = None  # the flag words as the GPU sees them (flag_words)
        self._native = self._call(_native().CudaHandoff, self.max_tokens, self.top_k)
        self._experts = experts  # their packed buffers are the ones the native layers compute with
        self._index: dict[int, int] = {}
        self._staging: dict[int, _Staging] = {}
        self._pending: dict[int, int] = {}  # layer -> T of an enqueue_submit not yet waited for
        self._linked: dict[int, CudaHandoff] = {}  # layer -> the handoff of its deferred part (link_deferred)
        allowed = os.sched_getaffinity(0)
        # layer -> workers of its pool here (the same packed weights as its CpuExperts; another pool
        # only when that one would leave no CPU free)
        self.threads = {layer: handoff_threads(ex.threads, len(allowed)) for layer, ex in experts.items()}
        self.driver_cpus: set[int] = set(allowed)
        """The CPUs every layer's pool leaves free: where the thread that drives the GPU belongs (pinned)."""
        for layer, ex in experts.items():
            st = ex.packed_state()
            self.driver_cpus &= driver_cpus(self.threads[layer], st["numa_nodes"], allowed)
            E, H, I = st["shape"]
            if self.top_k > E:
                raise HybridMoEError(f"top_k {self.top_k} exceeds layer {layer}'s {E} CPU experts")
            s = _Staging(self.max_tokens, H, self.top_k, dtype, ids_dtype)
            self._index[layer] = self._call(
                self._native.add_layer, E, H, I, st["format"], st["group_size"], st["zero_points"],
                self.threads[layer], ex.isa, st["numa_nodes"], st["buffers"], s.x, s.ids, s.weights, s.out)
            self._staging[layer] = s
        self.path = self._choose_path(path)

    def _choose_path(self, path: str) -> str:
        """Start the stream-memory-op mode if asked for (or "auto" and the probe passes)."""
        if path == "host_function":
            log.info("CUDA handoff: host functions (asked for)")
            return path
        # [words] int32, one 64-byte line per flag; pinned, hence mapped for the GPU (unified addressing)
        self._flags = torch.zeros(self._native.flag_words, dtype=torch.int32, pin_memory=True)
        with torch.cuda.device(self.device):  # the driver calls below use the current context
            why = self._native.probe_stream_mem_ops(self._flags)
            if not why:
                self._call(self._native.start_polling, self._flags, True)
                log.info("CUDA handoff: stream memory operations (cuStreamWriteValue32/cuStreamWaitValue32) "
                         "and a polling thread; %d CPU workers", max(self.threads.values()))
                return "stream_mem_ops"
        if path == "stream_mem_ops":
            raise HybridMoEError(f"the CUDA handoff cannot use stream memory operations here: {why}")
        log.warning("CUDA handoff: host functions (stream memory operations unavailable: %s)", why)
        return "host_function"

    @property
    def zero_copy(self) -> bool:
        """Stage the rows with one kernel that writes the pinned buffers through the device's mapping of
        them, and hand the output back as that mapping (enqueue_wait/enqueue without `out`: a tensor
        over the staging buffer, valid until the layer is enqueued again), instead of four copies.
        Needs triton. Set before the work is enqueued (or a graph captured).

        Off by default here; HybridExperts turns it on (HybridTuning.zero_copy): the gap between layers
        54 vs 69 µs in every sample of a Qwen3-30B-A3B decode, int4 and bf16."""
        return self._zero_copy

    @zero_copy.setter
    def zero_copy(self, on: bool) -> None:
        if on:
            if importlib.util.find_spec("triton") is None:
                raise HybridMoEError("zero_copy needs triton (its staging kernel), which is not installed")
            for s in self._staging.values():
                if s.mapped is None:
                    s.map(self.device)
        self._zero_copy = bool(on)

    @property
    def trim_padding(self) -> bool:
        """One token's CPU work leaves out its trailing slots of weight 0 (the padding fixed shapes give a
        token whose other experts are on the GPU: a repeat of one of its own experts) instead of
        computing them. Set between steps."""
        return self._native.trim_padding

    @trim_padding.setter
    def trim_padding(self, on: bool) -> None:
        self._native.trim_padding = bool(on)

    def help_until(self, event: torch.cuda.Event) -> None:
        """Work in the layers' pool as one more worker (the calling thread, GIL released) until `event`
        (recorded) completes; the caller then synchronizes on it as usual (an error shows there)."""
        self._call(self._native.help_until, event.cuda_event)

    @property
    def tuning(self) -> EngineTuning:
        """The layers' schedule and prefetch knobs (tune() sets them alike; this reads the first layer's)."""
        return from_native(self._call(getattr, self._native, "tuning"))

    def tune(self, tuning: EngineTuning) -> None:
        """Every knob of `tuning` for every layer's CPU work (hybridmoe.experts.tuning), so that benchmarks
        compare schedules in the running pipeline. Set between steps."""
        self._call(setattr, self._native, "tuning", to_native(tuning, _native().MoeTuning))

    @staticmethod
    def _call(fn, *args):
        try:
            return fn(*args)
        except (ValueError, TypeError, RuntimeError) as e:
            raise HybridMoEError(str(e)) from None

    @property
    def layers(self) -> list[int]:
        return list(self._index)

    def _stream(self, stream: torch.cuda.Stream | None) -> torch.cuda.Stream:
        stream = torch.cuda.current_stream(self.device) if stream is None else stream
        if stream.device != self.device:
            raise HybridMoEError(f"stream is on {stream.device}, the handoff on {self.device}")
        return stream

    def _check_gpu(self, name: str, t: torch.Tensor, shape: tuple[int, int], dtypes) -> None:
        if not isinstance(t, torch.Tensor) or t.device != self.device:
            where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
            raise HybridMoEError(f"{name} must be a tensor on {self.device}, got {where}")
        if t.layout != torch.strided:
            raise HybridMoEError(f"{name} must be a dense tensor, got layout {t.layout}; call .to_dense() first")
        if tuple(t.shape) != shape:
            raise HybridMoEError(f"{name} has shape {list(t.shape)}, expected {list(shape)}")
        if t.dtype not in dtypes:
            raise HybridMoEError(f"{name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")

    def enqueue_submit(self, stream: torch.cuda.Stream | None, layer: int, hidden: torch.Tensor,
                       topk_ids: torch.Tensor, topk_weights: torch.Tensor, staged: bool = False,
                       signaled: bool = False) -> None:
        """On `stream`: copy hidden [T, H], topk_ids [T, K], topk_weights [T, K] to the staging
        buffers, then start the layer on the CPU (the host function returns at once).

        staged (zero_copy): a kernel already on `stream` wrote them to staging(layer, T): no copy. signaled
        (staged, stream_mem_ops path): that kernel also cleared the layer's done word and wrote its go word
        (flag_words), so nothing more is enqueued here."""
        stream = self._stream(stream)
        if layer in self._pending:
            raise HybridMoEError(f"layer {layer} was submitted twice; enqueue_wait it first")
        if signaled and not staged:
            raise HybridMoEError("signaled needs staged: the kernel that writes go writes the rows first")
        if staged and not self._zero_copy:
            raise HybridMoEError("staged rows need zero_copy (they are written through the device's mapping)")
        T = self._stage(stream, layer, hidden, topk_ids, topk_weights, copy=not staged)
        if signaled:
            self._flags_path("signaled")
        else:
            self._call(self._native.enqueue_submit, stream.cuda_stream, self._index[layer], T)
        self._pending[layer] = T

    def enqueue_wait(self, stream: torch.cuda.Stream | None, layer: int,
                     out: torch.Tensor | None = None, in_kernel: bool = False) -> torch.Tensor:
        """On `stream`: block until the layer's CPU work is done, then copy its output [T, H] to
        `out` (allocated on the GPU if None; with zero_copy, None hands back the mapping) and return it.

        in_kernel (zero_copy, no out, stream_mem_ops path): nothing is enqueued; the mapping is handed back
        at once and the kernel that reads it must first wait for the layer's done word (flag_words) itself."""
        stream = self._stream(stream)
        if layer not in self._pending:
            raise HybridMoEError(f"layer {layer} has no enqueue_submit to wait for")
        T = self._pending[layer]
        if in_kernel:
            self._flags_path("in_kernel")
            if out is not None or not self._zero_copy:
                raise HybridMoEError("in_kernel waits hand back the mapping: they need zero_copy and no out")
            del self._pending[layer]
            return self._staging[layer].mapped.out[:T]
        out = self._out(stream, layer, T, out)
        self._call(self._native.enqueue_wait, stream.cuda_stream, self._index[layer], T)
        del self._pending[layer]
        return self._give_out(stream, layer, T, out)

    def staging(self, layer: int, T: int) -> SimpleNamespace:
        """The first T rows of the layer's staging buffers as the GPU sees them (zero_copy): x [T, H] (dtype),
        ids [T, K] (ids_dtype), weights [T, K] float32; for a kernel that writes them (enqueue_submit staged)."""
        if not self._zero_copy:
            raise HybridMoEError("the staging buffers are mapped for the GPU only with zero_copy")
        if layer not in self._index:
            raise HybridMoEError(f"layer {layer} has no CPU experts in this handoff (layers: {self.layers})")
        if not 1 <= T <= self.max_tokens:
            raise HybridMoEError(f"T must be between 1 and max_tokens ({self.max_tokens}), got {T}")
        m = self._staging[layer].mapped
        return SimpleNamespace(x=m.x[:T], ids=m.ids[:T], weights=m.weights[:T])

    def flag_words(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(done, go): the layer's flag words as the GPU sees them, int32 [1] each (stream_mem_ops path), for
        kernels that play the stream's part of the protocol: clear done, then (after a system-wide fence)
        write go = T; wait for done == 1 before reading the output."""
        self._flags_path("flag_words")
        if layer not in self._index:
            raise HybridMoEError(f"layer {layer} has no CPU experts in this handoff (layers: {self.layers})")
        if self._flags_mapped is None:
            from hybridmoe.experts.mapped_staging import device_view

            self._flags_mapped = device_view(self._flags, self.device)
        i = self._index[layer]
        done, go = self._native.done_word(i), self._native.go_word(i)
        return self._flags_mapped[done:done + 1], self._flags_mapped[go:go + 1]

    @property
    def merged_go(self) -> int:
        """The flag a kernel ORs into a linked layer's go word (go = merged_go | T) to run its deferred part
        along (link_deferred); a plain go = T runs this part alone."""
        return self._native.merged_go

    def link_deferred(self, layer: int, other: "CudaHandoff") -> None:
        """Run `other`'s part of `layer` (the same layer's deferred experts) in
        one CPU call with this handoff's part, started by this handoff's go word alone: a kernel stages both
        parts' rows (x in this handoff's staging only; staging(layer, T) of each for ids and weights), clears
        both done words (flag_words of each) and writes this go word = merged_go | T. This done word is set as
        soon as its output is complete, other's once the deferred output is, which the CPU computes after it
        (while the GPU goes on). stream_mem_ops path and zero_copy, both handoffs."""
        self._flags_path("link_deferred")
        other._flags_path("link_deferred")
        if not (self._zero_copy and other._zero_copy):
            raise HybridMoEError("link_deferred needs zero_copy on both handoffs (a kernel stages both parts)")
        if layer not in self._index or layer not in other._index:
            raise HybridMoEError(f"layer {layer} is not in both handoffs (layers: {self.layers}, {other.layers})")
        if self.dtype != other.dtype:
            raise HybridMoEError(f"link_deferred: the handoffs' dtypes differ ({self.dtype}, {other.dtype})")
        self._call(self._native.link_deferred, self._index[layer], other._native, other._index[layer])
        self._linked[layer] = other  # keeps it (and its staging) alive as long as this one

    def _flags_path(self, what: str) -> None:
        if self.path != "stream_mem_ops":
            raise HybridMoEError(f"{what} needs the stream_mem_ops path (flag words), this handoff runs {self.path}")

    def enqueue(self, stream: torch.cuda.Stream | None, layer: int, hidden: torch.Tensor,
                topk_ids: torch.Tensor, topk_weights: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """D2H copies, the layer on the CPU (one host function: submit and wait), H2D copy; all on
        `stream`. Returns out [T, H] (allocated on the GPU if None; with zero_copy, see enqueue_wait)."""
        stream = self._stream(stream)
        if layer in self._pending:
            raise HybridMoEError(f"layer {layer} has an enqueue_submit not yet waited for; enqueue_wait it first")
        T = self._stage(stream, layer, hidden, topk_ids, topk_weights)
        out = self._out(stream, layer, T, out)
        self._call(self._native.enqueue_forward, stream.cuda_stream, self._index[layer], T)
        return self._give_out(stream, layer, T, out)

    def _give_out(self, stream, layer: int, T: int, out: torch.Tensor | None) -> torch.Tensor:
        """The layer's output [T, H] on the device: copied into out, or (zero_copy, no out) the mapping."""
        s = self._staging[layer]
        if out is None and self._zero_copy:
            return s.mapped.out[:T]
        with torch.cuda.stream(stream):
            out.copy_((s.mapped if self._zero_copy else s).out[:T], non_blocking=True)
        return out

    def run_on_host(self, layers: Sequence[int], T: int) -> None:
        """What the stream's CPU work does, here and without CUDA: each layer's CPU work on the first
        T staged rows, one after another, as this object's path runs it (the CPU step's own cost,
        for benchmarks)."""
        unknown = [layer for layer in layers if layer not in self._index]
        if unknown:
            raise HybridMoEError(f"layers {unknown} have no CPU experts in this handoff (layers: {self.layers})")
        T = _int_arg("T", T, 1, self.max_tokens)
        self._call(self._native.run, [self._index[layer] for layer in layers], T)

    def take_stats(self) -> dict | None:
        """stream_mem_ops path: what the polling thread saw since the last call (then zeroed);
        None on the host_function path. Counts, and totals in µs:

          layers, cpu_us         layers served; their CPU work (go seen -> done written)
          late_us                how late their go words may have been seen (the time since the
                                 poller's previous look at the flags: its reaction time)
          steps, first_cpu_us,   steps (runs of layers in increasing order); their first layers'
          first_late_us          CPU work and lateness alone (after the gap between steps)
          gaps, between_us       within a step, one layer's done -> the next one's go seen: the
                                 stream sees done, copies the output back, runs the next layer's
                                 GPU work (attention, router, ...), copies its rows out, writes go
          late_max_us,           the latest go of one layer; how many were later than 20 µs (the
          slow_lates, cpu_max_us poller off its CPU); the longest CPU work of one layer
        """
        if self.path != "stream_mem_ops":
            return None
        return {k.replace("_ns", "_us"): v / 1e3 if k.endswith("_ns") else v
                for k, v in self._native.take_stats().items()}

    def check(self) -> None:
        """Raise the first error the CPU work recorded since the last check (after a sync)."""
        err = self._native.take_error()
        if err is not None:
            raise HybridMoEError(f"CPU experts on the CUDA stream failed: {err}")

    def _stage(self, stream, layer: int, hidden, topk_ids, topk_weights, copy: bool = True) -> int:
        """Checks the inputs, enqueues their copies to the layer's staging buffers (unless not copy); returns T."""
        if layer not in self._index:
            raise HybridMoEError(f"layer {layer} has no CPU experts in this handoff (layers: {self.layers})")
        T = hidden.shape[0] if isinstance(hidden, torch.Tensor) and hidden.dim() == 2 else -1
        if not 1 <= T <= self.max_tokens:
            raise HybridMoEError(f"hidden must be [T, H] with 1 <= T <= max_tokens ({self.max_tokens}), "
                                 f"got shape {list(getattr(hidden, 'shape', []))}")
        s = self._staging[layer]
        # staged: the kernel that wrote the rows rounded them to the staging dtype
        self._check_gpu("hidden", hidden, (T, s.x.shape[1]), (self.dtype,) if copy else (*_HIDDEN_DTYPES, torch.float16))
        self._check_gpu("topk_ids", topk_ids, (T, self.top_k), _IDS_DTYPES)
        self._check_gpu("topk_weights", topk_weights, (T, self.top_k), _WEIGHT_DTYPES)
        if not copy:
            return T
        with torch.cuda.stream(stream):
            if self._zero_copy:
                from hybridmoe.experts.mapped_staging import copy_words

                m = s.mapped
                copy_words([(hidden.contiguous(), m.x[:T]), (topk_ids.to(m.ids.dtype).contiguous(), m.ids[:T]),
                            (topk_weights.float().contiguous(), m.weights[:T])])
            else:
                s.x[:T].copy_(hidden, non_blocking=True)
                s.ids[:T].copy_(topk_ids, non_blocking=True)
                s.weights[:T].copy_(topk_weights, non_blocking=True)
        return T

    def _out(self, stream, layer: int, T: int, out: torch.Tensor | None) -> torch.Tensor | None:
        """out checked, or a new device tensor for it (None with zero_copy: the mapping is handed back)."""
        H = self._staging[layer].out.shape[1]
        if out is None:
            if self._zero_copy:
                return None
            with torch.cuda.stream(stream):
                return torch.empty(T, H, dtype=self.dtype, device=self.device)
        self._check_gpu("out", out, (T, H), (self.dtype,))
        return out
