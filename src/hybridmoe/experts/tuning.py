"""Every knob that only benchmarks turn, in one place: results never depend on them, only timing does.

- EngineTuning: how the native CPU expert engine cuts and prefetches a call's work.
      experts.tune(EngineTuning(item_blocks=4))               # CpuExperts: later calls of this layer
      handoff.tune(replace(handoff.tuning, gate_up_tail=False))  # CudaHandoff: every layer it runs
- HybridTuning: the hybrid split's fixed-shape path (experts/hybrid_fixed.py).
      backend.tuning.help_decode_wait = False                 # HybridExperts: the next steps

The engine runs with the defaults; benchmarks turn the knobs to compare side by side. docs/decisions.md
holds the measurements behind each default.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from hybridmoe.errors import HybridMoEError

PREFETCH_TOUCH_MODES = (0, 1, 2, 3)


@dataclass(frozen=True)
class EngineTuning:
    """The schedule and prefetch knobs of one native engine (csrc/moe/moe_layer.h, MoeTuning)."""

    item_blocks: int = 0
    """32-row weight blocks per GEMM work item; 0 (the default) sizes items automatically (1 to 8 blocks,
    see balanced_items). A fixed size is for benchmarks that weigh the run's tail against per-item costs."""

    item_prefetch: int = 4096
    """Bytes of each weight stream (and of its scales) of a GEMM item prefetched into L2 as the item starts;
    0: none. Default 4096: a kernel's own prefetches run a fixed distance ahead of its loads, so without
    this head every new stream starts on demand misses."""

    kernel_prefetch_l1: int = 4096
    """Bytes ahead of its loads the memory-bound kernels prefetch weights into L1 (prefetcht0); 0: none.
    Default 4096: the fastest of 0/2/4/8 KiB in a decode loop (int8 T=1 268 vs 425 us per call)."""

    kernel_prefetch_l2: int = 16384
    """Bytes ahead of its loads the memory-bound kernels prefetch weights into L2 (prefetcht1); 0: none.
    Default 16384: with the L1 distance, 9-12 GB/s per core instead of 8-9 in a decode loop."""

    early_start: bool = True
    """A decode call (x converted on one thread) starts the GEMM run first: the workers join and prefetch
    their first items' weights while the calling thread converts x (gate/up items wait for its rows).
    Default on, with padded_counters: the two together were faster in 9 of 12 decode cells, the rest within 0.5%."""

    padded_counters: bool = True
    """The counters workers count down (per active expert, per down block) each on a cache line of its own,
    so that neighbouring ones do not bounce one line between cores; off: packed. Default on (see early_start)."""

    tail_split: bool = True
    """The run's last down items (about two blocks per thread) are cut into 1-block items, so that the
    workers run out of work within a small item of each other. Default on."""

    gate_up_tail: bool = True
    """Each side's (own, deferred) last gate/up items (about two blocks per thread) are cut into 1-block
    items, so that no expert's gate/up ends a whole item after the others' and holds up its down items.
    Default on: a Qwen3-30B-A3B int4 decode ran 5-9% faster with it."""

    balanced_items: bool = True
    """Automatic item sizes chosen so that the run should end soonest, by the gate/up items' rounds over the
    workers and all the work over them; off: about 4 items per thread. Default on: 6-expert one-token calls
    0.137 vs 0.149 ms (int4) against a fixed item size."""

    combine_in_run: bool = True
    """Calls of up to 16 tokens sum the experts' outputs per block of columns inside the GEMM run (the last
    expert to finish a block sums it), else in a pass after it. Default on: in decode the pass after the run
    is a few microseconds on one thread, on the critical path."""

    prefetch_touch: int = 0
    """How CpuExperts.prefetch reads each 64-byte line: 0 prefetcht1 (into L2), 1 prefetcht0 (into L1),
    2 a load, 3 a load then cldemote (on to the L3, which every core reads). Default 0, the plain hint:
    prefetch() is a benchmark's experiment, not called by the engine."""

    def __post_init__(self) -> None:
        for name in ("item_blocks", "item_prefetch", "kernel_prefetch_l1", "kernel_prefetch_l2"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise HybridMoEError(f"{name} must be an int >= 0, got {value!r}")
        if self.prefetch_touch not in PREFETCH_TOUCH_MODES or isinstance(self.prefetch_touch, bool):
            raise HybridMoEError(f"prefetch_touch must be 0 (prefetcht1), 1 (prefetcht0), 2 (loads) or "
                                 f"3 (loads + cldemote), got {self.prefetch_touch!r}")
        for f in fields(self):
            if f.type in (bool, "bool") and not isinstance(getattr(self, f.name), bool):
                raise HybridMoEError(f"{f.name} must be a bool, got {getattr(self, f.name)!r}")


def to_native(tuning: EngineTuning, native_type):
    """tuning as the native engine's MoeTuning (native_type: hybridmoe._native.MoeTuning)."""
    if not isinstance(tuning, EngineTuning):
        raise HybridMoEError(f"tune() takes an EngineTuning, got {type(tuning).__name__}")
    out = native_type()
    for f in fields(EngineTuning):
        setattr(out, f.name, getattr(tuning, f.name))
    return out


def from_native(native) -> EngineTuning:
    """A native MoeTuning as an EngineTuning."""
    return EngineTuning(**{f.name: getattr(native, f.name) for f in fields(EngineTuning)})


@dataclass
class HybridTuning:
    """The fixed-shape path's switches, each on by default; benchmarks turn them off to measure what they give.
    Results never depend on them, only timing does."""

    zero_copy: bool = True
    """The handoffs stage rows and hand outputs back through the device's mapping of their pinned buffers
    (CudaHandoff.zero_copy; needs triton) instead of copies. Read by use_fixed_shapes. Default on: the gap between
    layers 54 vs 69 us in a Qwen3-30B-A3B decode."""

    kernel_flags: bool = True
    """With zero_copy and the fused router: its kernel (route_split) writes the CPU's rows to the handoff's
    staging buffers and, on the stream-memory-operations path, the layer's go word, and the kernel that sums the
    layer's parts waits for the done word itself (no kernel or stream-memory node of their own). Read when a step
    is enqueued (captured). Default on: 1.09x int4 decode, 1.02x bf16."""

    prefetch_next: bool = True
    """While a layer's CPU part runs, the GPU prefetches into its L2 the weights the model handed prefetch_during
    (the next layer's attention projections and router), so that the GEMVs after the wait read them from L2. Read
    when a step is enqueued (captured). Default on: the gap between two layers' CPU parts 3.5 us shorter."""

    pin_decode_thread: bool = True
    """decode_thread() pins the thread that drives the GPU on the CPUs the handoffs' pools leave free."""

    help_decode_wait: bool = True
    """With a pinned decode thread and a polling handoff, wait_step works in the handoffs' pool as one more worker
    until the step's event completes, instead of spinning in CUDA's wait. Default on: 1.06-1.09x bf16 decode."""
