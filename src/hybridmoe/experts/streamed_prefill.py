"""Long prefill steps: each layer's CPU experts streamed to the GPU over PCIe and run there.

For a step of many tokens the CPU's FLOP/s, not its memory bandwidth, bound the routed experts:
a Qwen3-30B-A3B layer at 2048 tokens is ~50 ms on 16 AMX cores, while its packed int4 experts
(302 MB) cross PCIe gen5 in ~6 ms. So from prefill_streaming_tokens tokens on (system/auto.py
decides whether and from where), a layer's CPU share runs on the GPU instead:

    layer L:   copy stream  [copy L+1 packed bytes -> slot B]            (overlaps L's compute)
               compute      [wait copy L] [dequantize + experts of L from slot A]
    layer L+1: compute      [wait copy L+1] [... slot B] ; copy L+2 -> slot A after L's compute

After the last layer comes the first again: its copy overlaps the end of this step and the start of
the next (a long prompt's next chunk, or the next prompt), so no layer's copy waits in the open.

The packed bytes are copied as the CPU engine holds them (CpuExperts.packed_state(): a quarter
of bf16's for int4), from host memory registered with cudaHostRegister (async DMA, no bounce
copy; pageable copies with a log line when registering fails), into two device slots each the
size of the largest layer (or, above SLOT_BYTES, of the largest part of consecutive experts: the
parts then take turns in the slots like layers), and dequantized on the GPU a chunk of experts at a time
(experts/packed_torch.py: one Triton pass on CUDA, experts/packed_triton.py; bit-exact with the CPU
engine's weights); their slots, with those of the layer's GPU-resident experts, run through the GPU
share's grouped Triton kernels (gpu_experts_triton.py), sorted by expert once a layer: no host sync
and nothing per expert on the host. On the CPU device the same code runs with plain copies and the
torch references, which is how CI checks it.

On a GPU, attach() measures the layer's costs at load (measured_costs: the CPU path as the model runs
it, the copy, the device's work, each fitted as a + b x tokens), which give the token count from which
"auto" streams. The CPU side is timed as the model runs it (the routing and hidden states to the host,
the slots padded per token, the output back), not the engine alone scaled by a guessed factor: so timed,
it matches the model's own layers (Qwen3-30B-A3B bf16, 512 tokens: 23.1 ms against 22-25).
Every CPU expert of a streamed step is streamed: a split with the CPU (its engine running the first
experts of each layer beside the device's share) is slower (int4, 512 tokens: 14.5 ms a layer against 4.9).

T tokens, K experts per token, R = routed (token, slot) pairs, E experts, H hidden, I intermediate.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import time
import weakref
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from hybridmoe.config import format_bytes
from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.cpu_slots import compact_slots
from hybridmoe.experts.gpu_experts import (
    Biases,
    block_size,
    gpu_share,
    slot_blocks,
    triton_usable,
)
from hybridmoe.experts.packed_torch import PackedLayout, fused_dequant

log = logging.getLogger("hybridmoe.experts")

ALIGN = 256
"""Byte alignment of each packed buffer inside a slot (float32 views, coalesced reads)."""

DEQUANT_WORKSPACE_BYTES = 256 << 20
"""Device memory one chunk of experts may take while dequantized (with its temporaries)."""

DEQUANT_BYTES_PER_WEIGHT = 14
"""Peak bytes per weight of one matrix while an int4 chunk dequantizes with torch (codes, nibbles,
float32 codes, the float32 result), besides the compute-dtype copy the chunk keeps (2 bytes). The
Triton pass (experts/packed_triton.py) takes none."""


SLOT_BYTES = 1 << 30
"""Most packed bytes a slot is made for: a layer with more streams in parts of consecutive experts, each
copied into a slot and computed in turn (DeepSeek-V3 int4: 5.6 GiB a layer, 6 parts of 43 experts),
so that the two slots fit beside a budget's fixed part (two whole DeepSeek-V3 layers would take 11.2
GiB of a 16 GiB budget that already holds 7.5 GiB for a 2-layer cut). A copy-bound stream loses
nothing to it: the copies still follow each other with no gap."""


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def part_experts(layer_bytes: int, E: int) -> int:
    """Experts in each streamed part of a layer of E experts packed in layer_bytes (E: one part)."""
    return -(-E // max(1, -(-layer_bytes // SLOT_BYTES)))


def slot_bytes(layer_bytes: int, E: int) -> int:
    """Most bytes a slot takes for a layer of E experts packed in layer_bytes, or for one with fewer of
    the same experts (the CPU's share of it): a part is at most SLOT_BYTES and one expert more, with each
    buffer's rounding up to ALIGN."""
    return min(_aligned(layer_bytes), SLOT_BYTES + -(-layer_bytes // E) + 64 * ALIGN)


def dequant_chunk_experts(H: int, I: int, fused: bool) -> int:
    """Experts dequantized at once, so one chunk stays within DEQUANT_WORKSPACE_BYTES; fused: by the
    Triton pass (no temporaries)."""
    per_expert = 3 * H * I * 2 + (0 if fused else H * I * DEQUANT_BYTES_PER_WEIGHT)
    return max(1, DEQUANT_WORKSPACE_BYTES // per_expert)


def device_bytes(layer_bytes: int, E: int, H: int, I: int, top_k: int, max_tokens: int) -> int:
    """Device memory streaming takes: two slots (slot_bytes: a part of a large layer), one dequantized chunk (at most
    DEQUANT_WORKSPACE_BYTES), and a max_tokens step's rows: per slot (S = max_tokens x top_k) the
    grouped kernels' float32 h [S, I] and outputs [S, H], per token the input in the compute dtype,
    the chunk's float32 sum and the layer's (2 + 4 + 4 bytes an element; float32 models, which only
    tiny test models are, take 2 more)."""
    dequant = max(min(E, dequant_chunk_experts(H, I, fused)) * (3 * H * I * 2 + (0 if fused else
                  H * I * DEQUANT_BYTES_PER_WEIGHT)) for fused in (False, True))
    rows = max_tokens * top_k * (H + I) * 4 + max_tokens * H * 12
    return 2 * slot_bytes(layer_bytes, E) + dequant + rows


def layer_packed_bytes(fmt: str, E: int, H: int, I: int, group_size: int, zero_points: bool) -> int:
    """Bytes of one layer's E experts as the native engine packs them (padding included), slot-aligned."""
    layout = PackedLayout({"shape": [E, H, I], "format": fmt, "group_size": group_size,
                           "zero_points": zero_points and fmt == "int4", "numa_nodes": 1})
    return sum(_aligned(n) for n in layout.buffer_bytes().values())


def reserved_bytes(engine_config, E: int, H: int, I: int, top_k: int) -> int:
    """What placement sets aside for streaming under engine_config (resolved: 0 unless "on")."""
    if engine_config.prefill_streaming != "on":
        return 0
    fmt = "bf16" if engine_config.expert_format == "auto" else engine_config.expert_format  # unresolved: the most
    layer_bytes = layer_packed_bytes(fmt, E, H, I, engine_config.expert_group_size_or_default,
                                     bool(engine_config.expert_zero_points))
    return device_bytes(layer_bytes, E, H, I, top_k, engine_config.max_num_batched_tokens)


def attach(backend, engine_config):
    """Give a HybridExperts backend a PrefillStreamer when engine_config (resolved) says "on" and its CPU
    engines are native. Returns engine_config as attached: with prefill_streaming_tokens, when it was
    left None, from the layer's costs measured here (measured_costs, kept as streamer.measured;
    StepCosts.threshold), or prefill_streaming "off" when they find the CPU faster on every step up to
    max_num_batched_tokens (or no streamer can run)."""
    if engine_config.prefill_streaming != "on" or not hasattr(backend, "stream_long_steps"):
        return engine_config
    engines = {layer: backend.cpu_engine(layer) for layer in backend.layers()}
    engines = {layer: e for layer, e in engines.items() if e is not None}
    if not engines or not all(hasattr(e, "packed_state") for e in engines.values()):
        return replace(engine_config, prefill_streaming="off")
    tokens = engine_config.prefill_streaming_tokens
    streamer = PrefillStreamer(engines, backend.device, tokens or 1)
    if tokens is None:
        fp = backend.plan.footprint
        streamer.measured, why = measured_costs(streamer, fp.top_k, fp.num_experts)
        tokens = streamer.measured.threshold()
        if tokens > engine_config.max_num_batched_tokens:
            log.info("prefill streaming off: %s", why)
            streamer.close()
            return replace(engine_config, prefill_streaming="off")
        log.info("prefill streaming from %d tokens: %s", tokens, why)
    streamer.min_tokens = tokens
    backend.stream_long_steps(streamer)
    log.info("prefill steps of %d+ tokens stream each layer's CPU experts to %s (%s per layer slot)",
             streamer.min_tokens, backend.device, format_bytes(streamer.slot_bytes))
    return replace(engine_config, prefill_streaming_tokens=tokens)


TIMED_TOKENS = (128, 512)
"""Steps timed at load (measured_costs), on the CPU engine and on the device: each is near affine in the
tokens (a part per weight read or dequantized, a part per token), and two points fix both."""


def cpu_path_seconds(engine, device: torch.device, tokens: int, share: float, top_k: int, repeats: int = 2) -> float:
    """Fastest of `repeats` runs of a step's CPU share the way the CPU path runs it (experts/hybrid.py's
    _Partial, not streamed): `tokens` tokens routed at random to top_k of E = CPU experts / share experts
    on `device`, the routing and the bf16 hidden states (scale 0.1) to the host, the CPU experts' slots
    made dense per token (compact_slots: padded with weight 0 up to the busiest token's count), the
    engine, its output back to `device`; the host waits for the device at both ends."""
    E_cpu, H = (int(v) for v in engine.packed_state()["shape"][:2])
    ids, weights, x = _random_step(tokens, max(E_cpu, round(E_cpu / share)), H, top_k, device)  # CPU's: ids < E_cpu
    best = math.inf
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        ids_c, w_c = ids.cpu(), weights.float().cpu()
        dense = compact_slots(ids_c, w_c, ids_c < E_cpu)
        if dense is not None:
            engine.forward(x.to("cpu"), *dense).to(device)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def _random_step(tokens: int, E: int, H: int, top_k: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A timed step's inputs on device, the same for a token count: (ids [T, top_k] distinct of E each,
    weights [T, top_k] in [0, 1), x [T, H] bf16 of scale 0.1)."""
    g = torch.Generator().manual_seed(tokens)
    ids = torch.rand(tokens, E, generator=g).argsort(dim=1)[:, :min(top_k, E)].to(device)
    weights = torch.rand(ids.shape, generator=g).to(device)
    x = (torch.randn(tokens, H, generator=g) * 0.1).to(device, torch.bfloat16)
    return ids, weights, x


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_step_seconds(streamer: PrefillStreamer, layer: int, tokens: int, top_k: int) -> tuple[float, float]:
    """(copy, work) seconds of one layer on the streamer's device: its packed bytes copied into an empty
    slot, then a step of `tokens` tokens with random routing (top_k of its experts each, bf16 hidden
    states of scale 0.1) run from them; CUDA events on the copy and compute streams. A layer streamed in
    parts: its first part's times the number of parts."""
    host, dev = streamer.layers[layer], streamer.device
    E, H = host.layout.E, host.layout.H
    key, parts = streamer.keys[layer][0], len(streamer.keys[layer])  # a layer in parts: its first, times parts
    part = streamer.units[key]
    ids, weights, x = _random_step(tokens, E, H, top_k, dev)
    mask = ids < part.layout.E  # the first part's experts: 0..
    streamer.slot_layer, streamer.current = [None, None], None
    marks = [_mark(streamer.copy_stream)]
    slot = streamer._stage(key)
    marks.append(_mark(streamer.copy_stream))
    if streamer.copied[slot] is not None:
        torch.cuda.current_stream(dev).wait_event(streamer.copied[slot])
    marks.append(_mark(streamer._stream()))
    routed_experts(part.layout, streamer._slot_views(slot, part), x, ids, weights, mask, F.silu)
    marks.append(_mark(streamer._stream()))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        return parts * marks[0].elapsed_time(marks[1]) / 1e3, parts * marks[2].elapsed_time(marks[3]) / 1e3
    return parts * (marks[1] - marks[0]), parts * (marks[3] - marks[2])


def _second(run):
    """What run() returns the second time (the first warms up)."""
    run()
    return run()


def _mark(stream):
    """A CUDA event recorded on stream, or (no stream: the CPU device) the host clock."""
    if stream is None:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


@dataclass(frozen=True)
class StepCosts:
    """One layer's costs measured at load, in seconds for a step of T tokens: the CPU path's share of the
    step (every CPU expert, cpu_path_seconds) cpu_fixed + cpu_per_token x T; on the device, the copy of
    its packed bytes, and the work on them gpu_fixed + gpu_per_token x T (both for every CPU expert)."""

    cpu_fixed: float
    cpu_per_token: float
    copy: float
    gpu_fixed: float
    gpu_per_token: float

    def cpu(self, tokens: int) -> float:
        return self.cpu_fixed + self.cpu_per_token * tokens

    def stream(self, tokens: int) -> float:
        """A layer streamed, the next one's copy overlapping this one's work: the longer of the two."""
        return max(self.copy, self.work(tokens))

    def work(self, tokens: int) -> float:
        return self.gpu_fixed + self.gpu_per_token * tokens

    def threshold(self, limit: int = 1 << 16) -> int:
        """Fewest tokens (from the shortest step timed: shorter ones read only their routed experts'
        weights, which the fit does not describe) for which a layer streamed whole takes no longer than
        the CPU path, cpu(T) >= stream(T); limit + 1 if none up to limit does."""
        return next((t for t in range(TIMED_TOKENS[0], limit + 1) if self.cpu(t) >= self.stream(t)), limit + 1)


def measured_costs(streamer: PrefillStreamer, top_k: int, num_experts: int) -> tuple[StepCosts, str]:
    """The StepCosts of the streamer's layer with the most packed bytes, and a line saying what was measured.

    Its CPU path (the CPU engine as the model runs it, the copies both ways included) and its streamed
    run are each timed at TIMED_TOKENS (after a first run that wakes the pool, registers the host memory,
    compiles the kernels for the step's shapes) and fitted as a + b x tokens; num_experts: the layer's
    routed experts (the CPU's get their share of each token's top_k)."""
    layer = max(streamer.layers, key=lambda i: streamer.layers[i].nbytes)
    engine, E = streamer.engines[layer], streamer.layers[layer].layout.E
    share = E / num_experts
    cpu_path_seconds(engine, streamer.device, TIMED_TOKENS[0], share, top_k, repeats=1)
    t1, t2 = TIMED_TOKENS
    c1, c2 = (cpu_path_seconds(engine, streamer.device, t, share, top_k) for t in TIMED_TOKENS)
    (copy1, g1), (copy2, g2) = (_second(lambda t=t: device_step_seconds(streamer, layer, t, top_k))
                                for t in TIMED_TOKENS)
    streamer.slot_layer = [None, None]
    cpu_per_token, gpu_per_token = max((c2 - c1) / (t2 - t1), 1e-9), max((g2 - g1) / (t2 - t1), 0.0)
    copy = min(copy1, copy2)
    costs = StepCosts(max(0.0, c1 - cpu_per_token * t1), cpu_per_token, copy, max(0.0, g1 - gpu_per_token * t1),
                      gpu_per_token)
    nbytes = streamer.layers[layer].nbytes
    return costs, (f"measured at load on layer {layer} ({E} CPU experts): the CPU path {1e3 * c1:.1f} ms at {t1} "
                   f"tokens, {1e3 * c2:.1f} ms at {t2}; streamed, the copy of {format_bytes(nbytes)} "
                   f"{1e3 * copy:.1f} ms ({nbytes / copy / 1e9:.1f} GB/s), the device's work {1e3 * g1:.1f} ms at "
                   f"{t1} tokens, {1e3 * g2:.1f} ms at {t2}")


class _HostPart:
    """Experts e0.. of one layer's packed buffers on the host (each buffer holds one expert after another),
    and where each buffer goes in a slot."""

    def __init__(self, state: dict, buffers: dict[str, torch.Tensor], e0: int):
        self.layout, self.buffers, self.e0 = PackedLayout(state), buffers, e0
        self.offsets, offset = {}, 0
        for name, buf in self.buffers.items():
            self.offsets[name] = offset
            offset += _aligned(buf.numel())
        self.nbytes = offset


class _HostLayer(_HostPart):
    """One layer's packed buffers on the host, and the parts it streams in (itself when it fits a slot)."""

    def __init__(self, engine):
        state = engine.packed_state()
        # torch views of the engine's memory (numpy views that keep the engine alive)
        super().__init__(state, {name: torch.from_numpy(arr).view(torch.uint8)
                                 for name, arr in state["buffers"].items()}, 0)
        self.registered: list[int] = []  # host pointers registered with CUDA (until the streamer goes)
        self.register_attempted = False  # cudaHostRegister called for its buffers (once)
        E, n = self.layout.E, part_experts(self.nbytes, self.layout.E)
        self.parts = [self] if n == E else [
            _HostPart(dict(state, shape=[min(n, E - e0), self.layout.H, self.layout.I]),
                      {name: buf.view(E, -1)[e0:e0 + n].reshape(-1) for name, buf in self.buffers.items()}, e0)
            for e0 in range(0, E, n)]


class PrefillStreamer:
    """Runs the CPU share of long steps on `device` from packed experts streamed there, layer by layer.

    engines: MoE layer -> its CPU engine (CpuExperts: anything with packed_state()). min_tokens:
    steps of at least this many tokens take this path (takes()). measured: the costs attach measured
    at load (for the threshold and reports), or None.

    What the two slots hold are units: a layer, or for a layer above SLOT_BYTES, a part (layer, p) of
    its experts; units are copied in order (keys: per layer its units; order: all units), each slot
    refilled as soon as its unit's last reader is done.
    """

    def __init__(self, engines: dict, device: str | torch.device, min_tokens: int):
        self.device, self.min_tokens = torch.device(device), int(min_tokens)
        self.measured: StepCosts | None = None
        self.engines = dict(engines)
        self.layers = {layer: _HostLayer(engine) for layer, engine in sorted(engines.items())}
        self.keys = {layer: [layer] if len(h.parts) == 1 else [(layer, p) for p in range(len(h.parts))]
                     for layer, h in self.layers.items()}
        self.units = {key: h.parts[0 if key == layer else key[1]]
                      for layer, h in self.layers.items() for key in self.keys[layer]}
        self.order = [key for layer in sorted(self.layers) for key in self.keys[layer]]
        size = max((u.nbytes for u in self.units.values()), default=0)
        self.slots = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(2)]
        self.slot_layer: list = [None, None]  # the unit each slot holds
        cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self.copied = [torch.cuda.Event() if cuda else None for _ in range(2)]  # slot's bytes arrived
        self.freed = [torch.cuda.Event() if cuda else None for _ in range(2)]  # slot's last reader done
        self.current = None  # the unit whose experts are being computed
        self.prefetch_next = True  # copy layer L+1 while L computes (off: every copy waited for, to measure)
        self._pinned_failed = False
        self._unregister = None
        if cuda:
            self._unregister = weakref.finalize(self, _unregister, [h.registered for h in self.layers.values()])
            self._unregister.atexit = False  # the process's end frees it all

    @property
    def slot_bytes(self) -> int:
        return self.slots[0].numel()

    def takes(self, hidden: torch.Tensor) -> bool:
        """Whether a step with these hidden states [T, H] runs on this path."""
        return hidden.shape[0] >= self.min_tokens and hidden.device.type == self.device.type

    def run(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
            mask: torch.Tensor, act, resident: tuple | None = None, deferred: int = 0, biases: Biases | None = None,
            resident_biases: Biases | None = None):
        """sum over slots with mask of weights * expert_ids(hidden): float32 [T, H] on the device; with
        resident (the layer's GPU experts: gate, up [G, I, H], down [G, H, I]), the other slots' too.

        hidden [T, H]; ids [T, K] local to the layer's CPU engine where mask [T, K] is set, to resident's
        experts elsewhere; weights [T, K]. A layer in parts: each part's slots (ids e0.. of the part,
        renumbered from 0), the resident experts' with the last. deferred > 0: the sums over the first
        K - deferred columns and over the last `deferred` apart, a pair, from one stream of the weights.
        act: F.silu or a ClampedSwiGLU; biases: the CPU engine's experts' (on the device), resident_biases the
        resident experts', or None (no biases).
        """
        extras = (act, resident, biases, resident_biases)
        if deferred:
            later = torch.arange(ids.shape[1], device=ids.device) >= ids.shape[1] - deferred  # [K]
            return tuple(self._run(layer, hidden, ids, weights, mask, extras, [~later, later]))
        return self._run(layer, hidden, ids, weights, mask, extras, [None])[0]

    def _run(self, layer, hidden, ids, weights, mask, extras: tuple, columns: list) -> list[torch.Tensor]:
        """run()'s sum for each entry of columns ([K] bool: the slots of those columns; None: all), every unit of
        the layer staged once for all of them; extras: run()'s (act, resident, biases, resident_biases)."""
        act, resident, biases, resident_biases = extras
        sides = [(weights, mask, ~mask) if cols is None else (weights * cols, mask & cols, ~mask & cols)
                 for cols in columns]
        keys, outs = self.keys[layer], [None] * len(sides)
        for p, key in enumerate(keys):
            slot = self._stage(key)
            self.current = key
            if self.copied[slot] is not None:
                torch.cuda.current_stream(self.device).wait_event(self.copied[slot])
            if self.prefetch_next:  # after the last unit the first, whose copy then overlaps the next step's start
                self._stage(self.order[(self.order.index(key) + 1) % len(self.order)])
            part, last = self.units[key], p == len(keys) - 1
            part_biases = None if biases is None else tuple(b[part.e0:part.e0 + part.layout.E] for b in biases)
            for i, (side_weights, side_mask, side_resident) in enumerate(sides):
                part_ids, part_mask = ids, side_mask
                if len(keys) > 1:
                    part_mask = side_mask & (ids >= part.e0) & (ids < part.e0 + part.layout.E)
                    part_ids = torch.where(part_mask, ids - part.e0, ids)  # the resident slots keep theirs
                y = routed_experts(part.layout, self._slot_views(slot, part), hidden, part_ids, side_weights, part_mask,
                                   act, resident if last else None, side_resident if last else None, part_biases,
                                   resident_biases if last else None)
                outs[i] = y if outs[i] is None else outs[i] + y
            if self.freed[slot] is not None:
                self.freed[slot].record(torch.cuda.current_stream(self.device))
        return outs

    def _stream(self):
        """The compute stream on CUDA; None on the CPU device (for _mark: the host clock)."""
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    def _stage(self, key) -> int:
        """The slot that holds (or is being filled with) a unit's packed bytes (key: a layer, or (layer, part));
        starts the copy if needed."""
        if key in self.slot_layer:
            return self.slot_layer.index(key)
        slot = 1 if self.slot_layer[0] == self.current else 0  # never the slot being computed from
        self.slot_layer[slot] = key
        unit = self.units[key]
        pairs = [(view, unit.buffers[name]) for name, view in self._slot_views(slot, unit).items()]
        if self.copy_stream is None:
            for dst, src in pairs:
                dst.copy_(src)
            return slot
        self._register(self.layers[key if isinstance(key, int) else key[0]])
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.freed[slot])  # the slot's previous layer is done with it
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
            self.copied[slot].record(self.copy_stream)
        return slot

    def _slot_views(self, slot: int, unit: _HostPart) -> dict[str, torch.Tensor]:
        """Where each of a unit's packed buffers lies in the slot: uint8 views of the device slot."""
        return {name: self.slots[slot][off:off + unit.buffers[name].numel()] for name, off in unit.offsets.items()}

    def _register(self, host: _HostLayer) -> None:
        """Page-lock the layer's host buffers once, so copies are DMA from them (no staging copy)."""
        if host.register_attempted or self._pinned_failed:
            return
        host.register_attempted = True
        if _PENDING:
            _unregister([])
        cudart = torch.cuda.cudart()
        for buf in host.buffers.values():
            err = cudart.cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
            if int(err) != 0:
                _clear_cuda_error()
                self._pinned_failed = True
                log.warning("prefill streaming copies from pageable memory, slower (cudaHostRegister failed: %s)",
                            cudart.cudaGetErrorString(err))
                return
            host.registered.append(buf.data_ptr())

    def close(self) -> None:
        """Unregister the host memory now (else when the streamer is collected, before the CPU engines
        it keeps alive can free that memory: a later mapping at the same addresses must not find the
        registration still there)."""
        if self._unregister is not None:
            torch.cuda.synchronize(self.device)  # no copy may still read the pages
            self._unregister()


_PENDING: list[list[int]] = []
"""Registrations of streamers collected during a CUDA-graph capture (where unregistering may not run),
undone before the next registration."""


def _unregister(registered: list[list[int]]) -> None:
    # A collected streamer has no copy in flight: every engine step ends in a host sync (sampling).
    if torch.cuda.is_current_stream_capturing():
        _PENDING.extend(registered)
        return
    cudart = torch.cuda.cudart()
    for ptrs in [*_PENDING, *registered]:
        for ptr in ptrs:
            cudart.cudaHostUnregister(ptr)
        ptrs.clear()
    _PENDING.clear()


def _clear_cuda_error() -> None:
    """A failed cudaHostRegister stays the CUDA runtime's last error, which torch would raise at its next
    check: read it off with cudaGetLastError, in the runtime torch already loaded (if it is found)."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_NOW).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue


def routed_experts(layout: PackedLayout, buffers: dict[str, torch.Tensor], x: torch.Tensor, ids: torch.Tensor,
                   weights: torch.Tensor, mask: torch.Tensor, act, resident: tuple | None = None,
                   resident_mask: torch.Tensor | None = None, biases: Biases | None = None,
                   resident_biases: Biases | None = None) -> torch.Tensor:
    """The masked routed experts of one layer computed from its packed buffers on x's device; float32 [T, H].
    resident: (gate, up, down) of G experts already on the device (dense tensors, or PackedMatrix:
    experts/packed_gpu.py), for the slots of resident_mask [T, K] (ids local to them there). act: F.silu or a
    ClampedSwiGLU; biases: the packed experts' (E rows, on x's device), resident_biases the resident ones' (G
    rows), or None.

    The layer's experts are dequantized a chunk of consecutive ids at a time into x's dtype (bf16/fp16;
    float32 stays float32). On CUDA with triton (and SiLU or the clamped SwiGLU) the slots are sorted into blocks of one expert
    once for the layer (the resident experts numbered after the packed ones), and each chunk runs the GPU
    share's grouped kernels over the blocks of its experts (_routed_triton: no host sync, a few
    launches a chunk; the host's launches, not the device, bounded a 512-token step when each chunk
    sorted its own slots); elsewhere each chunk's slots go through gpu_share's torch reference.
    """
    cdtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float32
    xc, ids = x.to(cdtype), ids.long()
    chunk = dequant_chunk_experts(layout.H, layout.I, fused=fused_dequant(x.device, layout.format))
    if resident is not None and (biases is None) != (resident_biases is None):
        raise HybridMoEError("routed_experts takes biases for both the packed and the resident experts, or neither")
    if triton_usable(x.device, act):
        return _routed_triton(layout, buffers, xc, ids, weights, mask, chunk, (resident, resident_mask),
                              act, biases, resident_biases)
    out = torch.zeros((x.shape[0], layout.H), dtype=torch.float32, device=x.device)
    for c0 in range(0, layout.E, chunk):
        c1 = min(layout.E, c0 + chunk)
        gate, up, down = layout.dequantize(buffers, torch.arange(c0, c1, device=x.device), xc.dtype)
        inside = mask & (ids >= c0) & (ids < c1)  # [T, K] the chunk's slots
        out += gpu_share(xc, gate, up, down, ids - c0, weights, inside, act, _rows(biases, c0, c1))
    if resident is not None:
        out += gpu_share(xc, *resident, ids, weights, resident_mask, act, resident_biases)
    return out


def _rows(biases: Biases | None, e0: int, e1: int) -> Biases | None:
    """Experts e0 .. e1 - 1's rows of biases (None: None)."""
    return None if biases is None else tuple(b[e0:e1] for b in biases)


def _routed_triton(layout: PackedLayout, buffers: dict[str, torch.Tensor], x: torch.Tensor, ids: torch.Tensor,
                   weights: torch.Tensor, mask: torch.Tensor, chunk: int, resident_slots: tuple, act,
                   biases: Biases | None, resident_biases: Biases | None) -> torch.Tensor:
    """routed_experts with the Triton kernels of gpu_experts_triton.py; x in the compute dtype, ids long;
    resident_slots: routed_experts' (resident, resident_mask).

    S = T x K slots in NB blocks (slot_blocks) over the E packed experts and the G resident ones (ids
    E.. E + G - 1); chunk c sees only the blocks of its experts (the others' slots set to -1, which
    the kernels skip), its experts renumbered from 0. Every slot is in one block of one chunk, so the
    chunks share the h [S, I] and y [S, H] rows.
    """
    from hybridmoe.experts.gpu_experts_triton import down_launch, gate_up_launch

    T, K = ids.shape
    resident, resident_mask = resident_slots
    E, H, I, S = layout.E, layout.H, layout.I, ids.numel()
    G = resident[0].shape[0] if resident is not None else 0
    sid = torch.where(mask, ids, torch.where(resident_mask, E + ids, E + G)) if G else torch.where(mask, ids, E)
    block = block_size(S, E + G)
    block_expert, block_slots = slot_blocks(sid.reshape(S), E + G, block)  # [NB], [NB, block]
    NB = block_expert.numel()
    chunks = [(c0, min(E, c0 + chunk)) for c0 in range(0, E, chunk)] + ([(E, E + G)] if G else [])
    bounds = torch.tensor(chunks, dtype=torch.int32).to(x.device, non_blocking=True)  # [C, 2]
    of_chunk = (block_expert >= bounds[:, :1]) & (block_expert < bounds[:, 1:])  # [C, NB]
    chunk_slots = torch.where(of_chunk.unsqueeze(2), block_slots.unsqueeze(0), -1)  # [C, NB, block]
    chunk_expert = block_expert.unsqueeze(0) - bounds[:, :1]  # [C, NB], read where of_chunk
    w = weights.float().reshape(S)
    h = torch.empty(S, I, dtype=torch.float32, device=x.device)  # rows of slots not here stay unread
    y = torch.zeros(S, H, dtype=torch.float32, device=x.device)  # slots not here add 0
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # as gpu_experts_triton: fp32 stays exact
    experts = torch.arange(E, device=x.device)
    for c, (c0, c1) in enumerate(chunks):
        gate, up, down = resident if c0 == E else layout.dequantize(buffers, experts[c0:c1], x.dtype)
        chunk_biases = resident_biases if c0 == E else _rows(biases, c0, c1)
        be, bs = chunk_expert[c], chunk_slots[c]
        gate_up_launch(x, gate, up, be, bs, h, K, NB, block, precision, False, act, chunk_biases)
        down_launch(h, down, be, bs, w, y, NB, block, precision, False, x.dtype, chunk_biases)
    return y.view(T, K, H).sum(dim=1)


GPU_SECONDS_PER_WEIGHT = 5e-12
"""Device time a streamed layer takes per expert weight (dequantize + matmuls) at up to 2048 tokens on
an H200, for the estimate before loading (system/auto.py; the loader measures its own): a Qwen3-30B-A3B
int4 layer's 107 CPU experts (505M weights) take 3.4 ps a weight at 512 tokens, 4.4 at 2048."""


def streamed_layer_seconds(layer_bytes: int, layer_weights: int, pcie_bytes_per_s: float) -> float:
    """Time of one streamed layer when the next layer's copy overlaps this one's device work."""
    return max(layer_bytes / pcie_bytes_per_s, layer_weights * GPU_SECONDS_PER_WEIGHT)


def break_even_tokens(stream_seconds: float, cpu_flops: float, flops_per_token: float) -> int:
    """Fewest tokens for which a layer's CPU expert time (tokens x flops_per_token / cpu_flops) exceeds
    stream_seconds, the layer's time streamed."""
    return max(1, math.ceil(stream_seconds * cpu_flops / flops_per_token))
