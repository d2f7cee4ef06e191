"""The hybrid backend: each MoE layer's routed experts split between the GPU and the CPU engine.

Per layer, the experts the PlacementPlan puts on the GPU are stacked there (torch, the model's
dtype; with int4 / int8 CPU experts on CUDA, packed as the CPU engine packs them: gpu_format); the
others go to the CPU engine (native CpuExperts, or the torch reference on the CPU), which holds only those, renumbered 0..E_cpu-1. Each token's top-k is split by where its experts
live; the two partial outputs are summed in float32. submit() starts the CPU part (native submit
returns at once, the workers run without the GIL) and then the GPU part; wait() joins them.
With deferred_experts K, each token's K lowest-weighted experts run after the layer's own, and
their output joins the residual one decoder layer later (experts/deferral.py).

On CUDA, once use_fixed_shapes(max_tokens) says yes (every CPU engine is native), a step of at
most max_tokens tokens runs in shapes fixed by T alone, with no host sync, so a CUDA graph can
capture it: the CPU share goes through the CUDA handoff (experts/cuda_handoff.py: rows out, the native
engine run by the handoff's polling thread, the output back, all ordered on the stream, the rows and the
output through the device's mapping of pinned buffers by default (zero_copy); submitted before the GPU
share, waited for after it; the step's own thread pinned off the handoff pool's CPUs, decode_thread) and
the GPU share through fixed_shape_experts (experts/gpu_experts.py: Triton
kernels that read only the routed experts' weights); the glue around them (splitting the slots,
summing the parts) is one Triton kernel each (experts/decode_fused.py). By default (kernel_flags) the
router's kernel also writes the CPU's rows to the handoff and its go word, and the kernel that sums the
parts (and adds the residual, when the MoE block hands it over) waits for the done word: between two
layers' CPU work the GPU runs kernels only; while the CPU works, it prefetches the next layer's attention
weights into L2 (prefetch_next). Longer steps (prefill) and the CPU device
take the path above. Deferred experts use a second handoff of their own width. In fixed shapes a
layer's own CPU part and its deferred one are both sent to the CPU when the layer starts, and nothing
waits for the deferred part until it joins the residual with the next layer's output (its own and GPU
parts, and the deferred parts, summed once: the deferred output comes back while the GPU waits for
the next layer's CPU part): the CPU runs layer L's deferred experts while the GPU runs layer L+1's
attention, then L+1's own experts, with no wait between. By default (merged_deferral) the router's
kernel stages both parts and the CPU runs them as one call, which marks the own output done before it
computes the deferred experts (CudaHandoff.link_deferred); else the router's kernel splits the own
part, one more kernel the deferred part, and they are two calls one behind the other in stream order.
On the CPU device (and in prefill) a layer's own and deferred experts are one CPU call with two outputs
(submit_deferred: each expert's weights read once), the deferred output joining one layer later (same
result, no overlap).

T tokens, K experts per token, H hidden, E experts, I expert intermediate size.
`_Partial` is the one place a layer's CPU work is started and joined.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.base import ExpertBackend
from hybridmoe.experts.decode_fused import add_parts, route_split, split_slots, sum_parts
from hybridmoe.experts.deferral import DeferredOutputs, split_deferred
from hybridmoe.experts.gpu_experts import HAVE_TRITON, fixed_shape_experts, gpu_share, weighted_experts
from hybridmoe.experts.placement import PlacementPlan

log = logging.getLogger("hybridmoe.experts")


class TorchCpuLayer:
    """The torch reference in the CPU engine's place: submit computes at once, wait returns float32 [T, H]."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act=F.silu):
        self.gate, self.up, self.down, self.act = gate, up, down, act
        self._out: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.gate.shape[0]

    def submit(self, x, ids, weights) -> None:
        self._out = weighted_experts(x, self.gate, self.up, self.down, ids, weights, None, self.act)

    def submit_deferred(self, x, ids, weights, deferred: int) -> None:
        """As CpuExperts.submit_deferred: wait() returns (the first K - deferred slots' sum, the last deferred's)."""
        keep = ids.shape[1] - deferred
        self._out = tuple(weighted_experts(x, self.gate, self.up, self.down, i, w, None, self.act) if i.shape[1]
                          else torch.zeros(x.shape, dtype=torch.float32, device=x.device)
                          for i, w in ((ids[:, :keep], weights[:, :keep]), (ids[:, keep:], weights[:, keep:])))

    def wait(self) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        out, self._out = self._out, None
        return out


def compact_slots(ids: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The kept slots of each token as a dense [T, Kc] (Kc: the most any token keeps), or None if none.

    The native engine takes a dense [T, Kc] of distinct ids per token, so shorter rows are padded,
    with weight 0, by experts other tokens of the batch already use (no extra weight reads).
    """
    counts = keep.sum(dim=1)  # [T]
    width = int(counts.max()) if counts.numel() else 0
    if width == 0:
        return None
    order = torch.sort((~keep).to(torch.int32), dim=1, stable=True).indices[:, :width]  # kept slots first
    cids, cw = ids.gather(1, order), weights.gather(1, order)
    valid = torch.arange(width, device=ids.device) < counts.unsqueeze(1)  # [T, Kc]
    if bool(valid.all()):
        return cids, cw
    active = torch.unique(ids[keep])  # [n], n >= Kc distinct experts
    member = ((cids.unsqueeze(2) == active) & valid.unsqueeze(2)).any(dim=1)  # [T, n] a token's own experts
    free = torch.sort(member.to(torch.int32), dim=1, stable=True).indices  # the others first
    pad = active[free.gather(1, (torch.arange(width, device=ids.device) - counts.unsqueeze(1)).clamp(min=0))]
    return torch.where(valid, cids, pad), torch.where(valid, cw, torch.zeros_like(cw))


def two_part_slots(ids: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor, own: int
                   ) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """compact_slots of the first `own` columns and of the others, side by side: (ids [T, a + b], weights, b) for
    the engine's submit_deferred (b deferred slots per token), or None if no slot is kept. A padding slot (weight 0)
    may repeat an expert of the token's other side, which the engine allows."""
    sides = [compact_slots(ids[:, cols], weights[:, cols], keep[:, cols]) for cols in (slice(0, own), slice(own, None))]
    kept = [side for side in sides if side is not None]
    if not kept:
        return None
    return (torch.cat([i for i, _ in kept], 1).contiguous(), torch.cat([w for _, w in kept], 1).contiguous(),
            sides[1][0].shape[1] if sides[1] is not None else 0)


def _put(stacked: list[torch.Tensor], n: int, i: int, weights, device: torch.device) -> None:
    """Copy one expert's (gate, up, down) into row i of stacked [n, ...] buffers on device (made at the first)."""
    if not stacked:
        stacked.extend(torch.empty(n, *w.shape, dtype=w.dtype, device=device) for w in weights)
    for dst, w in zip(stacked, weights):
        dst[i].copy_(w)


class _Layer:
    """One MoE layer's split: its GPU experts (stacked) and its CPU engine, with the id maps."""

    def __init__(self, on_gpu: torch.Tensor, local: torch.Tensor, gpu_weights, cpu, device):
        self.on_gpu_cpu = on_gpu  # [E] bool
        self.on_gpu = on_gpu.to(device)
        self.local_cpu = local  # [E] global id -> index among its side's experts
        self.local = local.to(device)
        self.gpu_weights = gpu_weights  # (gate, up, down) on the device (tensors, or PackedMatrix), or None
        self.cpu = cpu  # TorchCpuLayer / CpuExperts, or None
        self.streamer = None  # PrefillStreamer (experts/streamed_prefill.py): long steps' CPU share on the device


class _Partial:
    """One submitted computation (a layer's experts, or its deferred ones): CPU part in flight + GPU part.

    handoff: (CudaHandoff, width) to run in fixed shapes on CUDA, or None for the synchronous path;
    in fixed shapes the CPU part starts at once and the GPU part at start_gpu() (else at finish()).
    fused: the fixed shapes' glue (split_slots, sum_parts) as one kernel each where it can.
    split: split_slots' outputs for ids, weights, already made (route_split), in fixed shapes only.
    part: (lo, hi), in fixed shapes: only the columns lo <= k < hi of ids, weights are this computation's.
    deferred (the synchronous path: streamed, or a CPU engine with submit_deferred): the last `deferred` columns
    are the layer's deferred experts, computed in the same CPU call or stream of the layer (their weights read
    once) and handed over by deferred_result().
    """

    def __init__(self, layer: int, st: _Layer, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 act, handoff=None, fused: bool = False, split: tuple | None = None, part: tuple | None = None,
                 staged: tuple[bool, bool] = (False, False), deferred: int = 0):
        self.layer, self.device, self.dtype, self.shape = layer, hidden.device, hidden.dtype, hidden.shape
        self.fused = fused
        self.cpu, self.handoff, self.cpu_out, self.gpu_out = None, None, None, None
        self.deferred_cpu_out = self.deferred_gpu_out = None  # deferred: the deferred experts' parts
        self._gpu_share = None  # fixed shapes: the GPU share's arguments until start_gpu
        self._signaled = False  # fixed shapes: the kernels signal the handoff's flags (HybridExperts.kernel_flags)
        self._done = None  # then: the done word the kernel that reads cpu_out waits for (finish)
        if handoff is not None:
            self._start_fixed(st, hidden, ids, weights, act, *handoff, split, part, staged)
            return
        streamed = st.cpu is not None and st.streamer is not None and st.streamer.takes(hidden)
        if streamed:  # the streamer runs the GPU experts' slots too, in the same grouped kernels
            out = st.streamer.run(layer, hidden, st.local[ids], weights, ~st.on_gpu[ids], act, st.gpu_weights, deferred)
            self.cpu_out, self.deferred_cpu_out = out if deferred else (out, None)
        elif st.cpu is not None:
            ids_c, w_c = ids.cpu(), weights.float().cpu()
            native_dtype = torch.bfloat16 if hidden.dtype == torch.float16 else hidden.dtype
            if deferred:
                dense = two_part_slots(st.local_cpu[ids_c], w_c, ~st.on_gpu_cpu[ids_c], ids.shape[1] - deferred)
                if dense is not None:
                    st.cpu.submit_deferred(hidden.to("cpu", native_dtype), *dense)
            else:
                dense = compact_slots(st.local_cpu[ids_c], w_c, ~st.on_gpu_cpu[ids_c])
                if dense is not None:
                    st.cpu.submit(hidden.to("cpu", native_dtype), *dense)
            self.cpu = st.cpu if dense is not None else None
        if st.gpu_weights is not None and not streamed:
            local, mask = st.local[ids], st.on_gpu[ids]
            if deferred:  # each side's GPU slots apart
                own = torch.arange(ids.shape[1], device=ids.device) < ids.shape[1] - deferred
                self.deferred_gpu_out = gpu_share(hidden, *st.gpu_weights, local, weights, mask & ~own, act)
                mask = mask & own
            self.gpu_out = gpu_share(hidden, *st.gpu_weights, local, weights, mask, act)

    def _start_fixed(self, st: _Layer, hidden, ids, weights, act, handoff, width: int, split=None, part=None,
                     staged: tuple[bool, bool] = (False, False)) -> None:
        """staged: (route_split already wrote the CPU's rows to the handoff's staging buffers, and also its
        go word)."""
        local, mask, cids, cw = split or split_slots(ids, weights, st.on_gpu, st.local,
                                                     width if st.cpu is not None else 0, self.fused, part)
        if st.cpu is not None:
            rows, self._signaled = staged
            handoff.enqueue_submit(None, self.layer, hidden if rows else hidden.to(handoff.dtype), cids, cw,
                                   staged=rows, signaled=self._signaled)
            self.handoff = handoff
        if st.gpu_weights is not None:
            self._gpu_share = (hidden, *st.gpu_weights, local, weights, mask, act)

    def start_gpu(self) -> None:
        """Enqueue the GPU share (fixed shapes): after the CPU work of every part of the layer is on its
        way, so that the GPU computes it while the CPU computes theirs."""
        if self._gpu_share is not None:
            self.gpu_out, self._gpu_share = fixed_shape_experts(*self._gpu_share), None

    def join_cpu(self) -> None:
        if self.cpu is not None:
            self.cpu_out, self.cpu = self.cpu.wait(), None
            if isinstance(self.cpu_out, tuple):  # submit_deferred's (own, deferred)
                self.cpu_out, self.deferred_cpu_out = self.cpu_out
        if self.handoff is not None:
            if self._signaled:  # the mapping at once; finish's kernel waits for the done word
                self._done = self.handoff.flag_words(self.layer)[0]
            self.cpu_out = self.handoff.enqueue_wait(None, self.layer, in_kernel=self._signaled)
            self.handoff = None

    def _parts(self) -> list[torch.Tensor]:
        self.start_gpu()
        self.join_cpu()
        return [p.to(self.device) for p in (self.cpu_out, self.gpu_out) if p is not None]

    def finish(self, folded: _Partial | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
        """[T, H] in the hidden state's dtype and device; plus folded's output (an earlier layer's deferred
        experts, joining here), summed with this one's parts before the one rounding. residual [T, H]: returned
        is residual + that (rounded once more, as torch adds them), in one kernel with the sum where it can.

        The kernel waits for one done word: this part's, else folded's. A merged deferred part (folded, signaled)
        needs no wait of its own behind this part's: the polling thread sets its done word when its call ends,
        before it serves any later layer (cuda_host_bindings.cpp, poll), so this part's done implies it."""
        parts = self._parts() + (folded._parts() if folded is not None else [])
        done = self._done if self._done is not None or folded is None else folded._done
        if residual is not None and 1 <= len(parts) <= 2:
            return add_parts(residual, parts, self.fused, done=done)
        if done is not None:  # the kernel waits for the CPU's output first
            out = sum_parts(parts, self.dtype, self.fused, done=done)
        elif not parts:
            out = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        elif len(parts) == 1:
            out = parts[0].to(self.dtype)  # one rounding, as through float32
        else:
            out = sum_parts(parts, self.dtype, self.fused)
        return out if residual is None else residual + out

    def add_to(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden + finish(), in one kernel where it can (add_parts; it waits for the done word, if signaled)."""
        parts = self._parts()
        return add_parts(hidden, parts, self.fused, done=self._done) if parts else hidden + torch.zeros_like(hidden)

    def deferred_result(self) -> "_DeferredOfPass":
        """The deferred experts' output (constructed with deferred), as a pending deferred computation."""
        return _DeferredOfPass(self)


class _DeferredOfPass:
    """The deferred experts of a _Partial that computed them in its own CPU call (the synchronous path): their
    output joins the residual as a separate _Partial's would (join_cpu, add_to)."""

    def __init__(self, owner: _Partial):
        self.owner = owner

    def join_cpu(self) -> None:
        self.owner.join_cpu()

    def add_to(self, hidden: torch.Tensor) -> torch.Tensor:
        self.join_cpu()
        parts = [p.to(hidden.device) for p in (self.owner.deferred_cpu_out, self.owner.deferred_gpu_out)
                 if p is not None]
        return add_parts(hidden, parts, self.owner.fused) if parts else hidden + torch.zeros_like(hidden)


class HybridExperts(ExpertBackend):
    """Routed experts placed by a PlacementPlan: some on `device`, the rest in a CPU engine.

    cpu_layer(gate, up, down) builds the CPU engine of one layer from the CPU experts' stacked
    weights (CpuExperts with the engine options, or TorchCpuLayer); where it also has
    from_experts(experts, n), set_layer_experts packs the CPU experts one at a time through it.
    """

    def __init__(self, plan: PlacementPlan, device: str | torch.device, cpu_layer: Callable, act=F.silu,
                 deferred_experts: int = 0, num_layers: int = 0, gpu_format: str | None = None):
        self.plan, self.device, self.act = plan, torch.device(device), act
        self._cpu_layer = cpu_layer
        self.gpu_format = gpu_format
        """None: GPU experts stacked in the model's dtype; "int4" / "int8": packed by cpu_layer (the native engine,
        in that format) and kept packed on the device (experts/packed_gpu.py; packed_gpu_format decides)."""
        self.deferred_experts = deferred_experts
        self._layers: dict[int, _Layer] = {}
        self._inflight: dict[int, tuple[_Partial, torch.Tensor, tuple | None]] = {}
        self._deferred = DeferredOutputs(num_layers)
        self._fixed_tokens = 0  # steps of at most this many tokens run in fixed shapes (use_fixed_shapes)
        self._fixed_dtype = torch.float32  # the hidden states' dtype use_fixed_shapes was given
        self._handoffs: dict[tuple[bool, int], tuple] = {}  # (deferred?, layer) -> (CudaHandoff, width)
        self._folded: dict[int, _Partial] = {}  # fixed shapes: layer -> the deferred part joining its output
        self.fused = True  # fixed-shape steps' glue in one kernel each on CUDA (decode_fused.py)
        self.pin_decode_thread = True  # decode_thread() pins the step's thread off the handoff pools' CPUs
        # wait_step: the step's thread, pinned on a CPU of its own, works in the handoffs' pool while it waits.
        # On the GPU host (session 16, deferral_decode.py, Qwen3-30B-A3B 12 layers, interleaved rounds, vs
        # spinning in CUDA's wait): bf16 1.085x (5 rounds) and 1.056x (7), CPU 450 vs 480-494 us per layer;
        # int4 1.013x (its layers' few items gain little from one more thread).
        self.help_decode_wait = True
        # the handoffs stage rows and hand outputs back through the device's mapping of their pinned buffers
        # (CudaHandoff.zero_copy; needs triton): on the GPU host the gap between layers 54 vs 69 µs, Qwen3-30B-A3B
        # 4 layers, int4 and bf16, every sample (device round r1 of session 5). Read by use_fixed_shapes.
        self.zero_copy = True
        self.kernel_flags = True
        """Fixed shapes, zero_copy, the fused router: its kernel (route_split) writes the CPU's rows (x, ids,
        weights) to the handoff's staging buffers itself, instead of a kernel of their own
        (mapped_staging.copy_words), and on the stream_mem_ops path also clears the layer's done word and writes
        its go word (no stream memory operations), and the kernel that sums the layer's parts waits for the done
        word itself (no cuStreamWaitValue32 node). Read when a step is enqueued (captured). On the GPU host,
        Qwen3-30B-A3B 4 layers, 2 interleaved rounds on one engine (with the residual added in the MoE): the gap
        between layers 41.6 vs 51.7 us (45.4 in the round without late gos) int4, 41.6 vs 46.0 bf16; decode 1.094x
        int4, 1.022x bf16 (device round r2 of session 6)."""
        self.merged_deferral = True
        """Fixed shapes with deferred experts, kernel_flags, the stream_mem_ops path: a layer's own CPU part and
        its deferred one run as one CPU call (CudaHandoff.link_deferred, MoeCall::deferred): the router's kernel
        stages both parts and writes one go; the CPU computes the own experts first and marks their output done at
        once, then the deferred experts, while the GPU goes on with the next layer; off: two calls, one behind the
        other, each with its own fixed cost. On the GPU host (session 9, deferral_decode.py, Qwen3-30B-A3B 12
        layers int4, 28 GPU experts per layer, K=1) one call vs two: 445.5 vs 433.9 tok/s (2 rounds), 296.9 vs
        345.7 (3 rounds on a disturbed host, samples 2.7-4.1 ms): no clear difference either way. Read by
        use_fixed_shapes (the handoffs are linked there) and when a step is enqueued."""
        self._merged: set[int] = set()  # layers whose handoffs use_fixed_shapes linked (merged_deferral)
        self.prefetch_next = True
        """Fixed shapes on CUDA: while a layer's CPU part runs, the GPU prefetches into L2 the weights given by
        prefetch_during (the next layer's attention and router), after the layer's GPU share. Read when a step
        is enqueued (captured); a layer with no CPU experts prefetches nothing (nothing to wait for). On the GPU host
        (r2 of session 6, as kernel_flags'): the gap 39.3 vs 41.6 us int4, 39.5 vs 41.6 bf16, in every sample (the
        qkv GEMV 7.1-7.6 us after the wait, 8.0 from HBM, 5.8 from L2); decode time per token the same (0.982 vs
        0.981 ms int4, 2.298 vs 2.299 bf16)."""
        self._prefetch: dict[int, list] = {}  # layer -> modules whose .weight to prefetch (prefetch_during)
        self._driver_cpus: set[int] = set()  # the CPUs the handoffs' pools leave free (use_fixed_shapes)

    def _split(self, layer: int, E: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gpu_ids, cpu_ids, on_gpu [E] bool, local [E]: each expert's index among its side's experts)."""
        gpu_ids = torch.tensor(self.plan.on_gpu(layer), dtype=torch.long)
        on_gpu = torch.zeros(E, dtype=torch.bool)
        on_gpu[gpu_ids] = True
        cpu_ids = (~on_gpu).nonzero().flatten()
        local = torch.empty(E, dtype=torch.long)
        local[gpu_ids] = torch.arange(len(gpu_ids))
        local[cpu_ids] = torch.arange(len(cpu_ids))
        return gpu_ids, cpu_ids, on_gpu, local

    def set_layer(self, layer, gate_proj, up_proj, down_proj):
        gpu_ids, cpu_ids, on_gpu, local = self._split(layer, gate_proj.shape[0])
        # index_select copies: the GPU side gets only its experts, the CPU engine only the others
        gpu = None
        if len(gpu_ids):
            gpu = self._on_device(tuple(w.index_select(0, gpu_ids.to(w.device)).to(self._gpu_staging)
                                        for w in (gate_proj, up_proj, down_proj)))
        cpu = None
        if len(cpu_ids):
            cpu = self._cpu_layer(*(w.index_select(0, cpu_ids.to(w.device)).cpu()
                                    for w in (gate_proj, up_proj, down_proj)))
        self._layers[layer] = _Layer(on_gpu, local, gpu, cpu, self.device)

    def set_layer_experts(self, layer, experts, num_experts: int):
        """set_layer from (gate, up, down) of one expert at a time, in expert order (as the loader reads them):
        each GPU expert goes to the device as it comes, and the CPU experts to cpu_layer.from_experts where
        it has one (the native engine packs them one at a time), else stacked for cpu_layer. No stacked
        copy of the whole layer is made."""
        gpu_ids, cpu_ids, on_gpu, local = self._split(layer, num_experts)
        gpu_slot = dict(zip(gpu_ids.tolist(), range(len(gpu_ids))))
        gpu: list[torch.Tensor] = []

        def cpu_experts():
            for e, weights in enumerate(experts):
                if e in gpu_slot:
                    _put(gpu, len(gpu_ids), gpu_slot[e], weights, self._gpu_staging)
                else:
                    yield weights

        from_experts = getattr(self._cpu_layer, "from_experts", None)
        if len(cpu_ids) and from_experts is not None:
            cpu = from_experts(cpu_experts(), len(cpu_ids))
        else:
            stacked: list[torch.Tensor] = []
            for i, weights in enumerate(cpu_experts()):
                _put(stacked, len(cpu_ids), i, weights, torch.device("cpu"))
            cpu = self._cpu_layer(*stacked) if stacked else None
        self._layers[layer] = _Layer(on_gpu, local, self._on_device(tuple(gpu)) if gpu else None, cpu, self.device)

    @property
    def _gpu_staging(self) -> torch.device:
        """Where a layer's GPU experts are stacked as they come: on the device, or on the CPU to be packed."""
        return torch.device("cpu") if self.gpu_format else self.device

    def _on_device(self, stacked: tuple[torch.Tensor, ...]) -> tuple:
        """A layer's GPU experts (gate, up, down), stacked in _gpu_staging, as the GPU share reads them."""
        if not self.gpu_format:
            return stacked
        from hybridmoe.experts.packed_gpu import pack_gpu_experts

        # the native packer makes the codes and scales the CPU engine would; its CPU copy goes once copied
        return pack_gpu_experts(self._cpu_layer(*stacked), self.device, stacked[0].dtype)

    def layers(self):
        return sorted(self._layers)

    def gpu_experts(self, layer: int) -> list[int]:
        return self.plan.on_gpu(layer)

    def cpu_engine(self, layer: int):
        """The CPU engine of layer (it holds only that layer's CPU experts), or None if all are on the GPU."""
        return self._layers[layer].cpu

    def stream_long_steps(self, streamer) -> None:
        """Run the CPU share of the steps streamer.takes() on the device from streamed experts
        (experts/streamed_prefill.py); None: every step's CPU share on the CPU engines."""
        for st in self._layers.values():
            st.streamer = streamer if st.cpu is not None else None

    def use_fixed_shapes(self, max_tokens: int, dtype: torch.dtype) -> bool:
        """On CUDA, run steps of at most max_tokens tokens in fixed shapes from now on (CUDA-graph
        capturable); dtype: the hidden states'. False, and nothing changes, when the device is not
        CUDA or a layer's CPU engine is not the native one (the handoff runs only that)."""
        if self.device.type != "cuda":
            return False
        try:
            from hybridmoe.experts.cpu_experts import CpuExperts
        except ImportError:
            return False
        cpu = {layer: st.cpu for layer, st in self._layers.items() if st.cpu is not None}
        if not all(isinstance(c, CpuExperts) for c in cpu.values()):
            return False
        if cpu:
            from hybridmoe.experts.cuda_handoff import CudaHandoff

            top_k = self.plan.footprint.top_k
            staged = torch.float32 if dtype == torch.float32 else torch.bfloat16
            # one handoff per (part, width): a layer's CPU slots per token are at most its CPU experts
            groups: dict[tuple[bool, int], dict] = {}
            for layer, c in cpu.items():
                for deferred, k in ((False, top_k - self.deferred_experts), (True, self.deferred_experts)):
                    if k:
                        groups.setdefault((deferred, min(k, c.num_experts)), {})[layer] = c
            handoffs = {}
            try:
                for (deferred, width), layers in groups.items():
                    handoff = CudaHandoff(layers, max_tokens, width, staged, device=self.device)
                    # one token's padding slots (weight 0: its experts on the GPU) are left out of its CPU
                    # work, not computed and added as 0 (the same sum; a deferred slot on the GPU leaves
                    # no CPU work at all). Measured on the GPU host, DeepSeek-V2-Lite int4 8 layers, same
                    # engine, 2 interleaved repeats: 360 (353-367) vs 340 (334-346) tok/s.
                    handoff.trim_padding = True
                    handoff.zero_copy = self.zero_copy and HAVE_TRITON
                    handoffs.update({(deferred, layer): (handoff, width) for layer in layers})
            except HybridMoEError as e:  # no usable CUDA runtime: the synchronous path still works
                log.warning("CPU experts run without the CUDA handoff (and decode steps without CUDA graphs): %s", e)
                return False
            self._handoffs = handoffs
            self._driver_cpus = set.intersection(*(h.driver_cpus for h, _ in handoffs.values()))
            self._merged = set()
            if self.deferred_experts and self.merged_deferral and self.kernel_flags and HAVE_TRITON:
                for layer in cpu:
                    own, later = handoffs.get((False, layer)), handoffs.get((True, layer))
                    if own and later and own[0].zero_copy and own[0].path == later[0].path == "stream_mem_ops":
                        own[0].link_deferred(layer, later[0])
                        self._merged.add(layer)
        self._fixed_tokens, self._fixed_dtype = max_tokens, dtype
        return True

    def prefetch_during(self, layer: int, modules: list) -> None:
        """While layer's CPU part runs (prefetch_next), prefetch up to three modules' .weight into the GPU's L2
        (read at enqueue time: the modules may get their weights after this call)."""
        if not 1 <= len(modules) <= 3:
            raise HybridMoEError(f"prefetch_during takes one to three modules, got {len(modules)}")
        self._prefetch[layer] = list(modules)

    def decode_thread(self):
        """A context for a fixed-shape step, around its launch and the wait for its result: the calling
        thread (which drives the GPU and spins in CUDA's waits) runs on the CPUs the CUDA handoffs' pools
        leave free (cuda_handoff.pinned), unless pin_decode_thread is False or none is free."""
        from hybridmoe.experts.cuda_handoff import pinned

        return pinned(self._driver_cpus if self.pin_decode_thread else set())

    def wait_step(self, done: torch.cuda.Event) -> None:
        """Wait for a fixed-shape step's event `done` (recorded after its tokens' copy). With help_decode_wait,
        a pinned decode thread (decode_thread) and a polling handoff, the thread first works in the handoffs'
        pool as one more worker until the event completes (CudaHandoff.help_until): the handoff pools leave its
        CPU free for it, and spinning in CUDA's wait would leave that CPU out of the layers."""
        if self.help_decode_wait and self.pin_decode_thread and self._driver_cpus:
            polling = next((h for h, _ in self._handoffs.values() if h.path == "stream_mem_ops"), None)
            if polling is not None:
                polling.help_until(done)
        done.synchronize()

    def set_deferred_experts(self, k: int) -> None:
        """Defer k experts per token from the next forward on (0: exact). In fixed shapes the CUDA handoffs
        are made again for the new split: drop every CUDA graph captured before (synchronize first), and
        capture them again."""
        top_k = self.plan.footprint.top_k
        if not 0 <= k < top_k:
            raise HybridMoEError(f"deferred experts must be between 0 and {top_k - 1} (the model routes {top_k} "
                                 f"experts per token), got {k}")
        if self._inflight or self._deferred.layers():
            raise HybridMoEError("deferred experts can change only between forwards")
        self.deferred_experts = k
        if self._fixed_tokens and not self.use_fixed_shapes(self._fixed_tokens, self._fixed_dtype):
            raise HybridMoEError("the CUDA handoffs could not be made again (the warning above says why)")

    def check(self) -> None:
        """Raise what a CPU layer run on the CUDA stream recorded (call after a synchronize)."""
        for handoff in {id(h): h for h, _ in self._handoffs.values()}.values():
            handoff.check()

    def _handoff(self, deferred: bool, layer: int, hidden: torch.Tensor):
        """(handoff, width) if this part runs in fixed shapes ((None, 0) for a layer with no CPU
        experts), None for the synchronous path."""
        if not (self._fixed_tokens and hidden.device.type == "cuda" and hidden.shape[0] <= self._fixed_tokens):
            return None
        return self._handoffs.get((deferred, layer), (None, 0))

    def forward_logits(self, layer, hidden, router_logits, top_k, renormalize, residual=None):
        """A fixed-shape step, fused on CUDA: the router's top-k and the split of the step's slots (both
        parts' with deferred experts) in one kernel (route_split), and residual + the output in the kernel
        that sums the parts (finish); anything else: None (the caller routes)."""
        fixed = self._handoff(False, layer, hidden)
        if fixed is None or not self.fused:
            return None
        st = self._layers[layer]
        kd, T = self.deferred_experts, hidden.shape[0]
        handoff, width = fixed
        stage = signal = merged = None
        if st.cpu is not None and self.kernel_flags and handoff.zero_copy:
            rows = handoff.staging(layer, T)
            stage = (hidden, rows.x, rows.ids, rows.weights)
            signal = handoff.flag_words(layer) if handoff.path == "stream_mem_ops" else None
        if signal is not None and kd and self.merged_deferral and layer in self._merged:
            # both parts staged by the router's kernel, and one go (merged) for the CPU's one call
            later_handoff, later_width = self._handoffs[(True, layer)]
            later_rows = later_handoff.staging(layer, T)
            merged = (later_width, later_rows.ids, later_rows.weights, later_handoff.flag_words(layer)[0])
            signal = (*signal, T | handoff.merged_go)
        routed = route_split(router_logits, top_k, renormalize, st.on_gpu, st.local, width if st.cpu is not None else 0,
                             self.fused, kd, stage, signal, merged)
        weights, ids, split = routed[:3]
        # the deferred part: the same [T, K] slots, its own columns (split once the layer's own part is on its way,
        # or already, merged); merged: already staged and started with the own part
        later = (ids, weights, (top_k - kd, top_k), routed[3] if merged else None) if kd else None
        self._submit_fixed(layer, hidden, ids, weights, split, later, (stage is not None, signal is not None))
        partial, _, _ = self._inflight.pop(layer)
        return partial.finish(self._folded.pop(layer, None), residual)

    def submit(self, layer, hidden, topk_ids, topk_weights):
        if self._handoff(False, layer, hidden) is not None:
            later = None
            if self.deferred_experts:
                topk_ids, topk_weights, *later = split_deferred(topk_ids, topk_weights, self.deferred_experts)
                later += [None, None]
            self._submit_fixed(layer, hidden, topk_ids, topk_weights, None, later)
            return
        self._restart_if_interrupted(layer)
        # the CPU engines run one call at a time: the previous layer's deferred experts first
        self._deferred.drain_cpu()
        later = None
        kd = self.deferred_experts
        if kd:
            topk_ids, topk_weights, *later = split_deferred(topk_ids, topk_weights, kd)
        st = self._layers[layer]
        streamed = st.streamer is not None and st.streamer.takes(hidden)
        if later is not None and st.cpu is not None and (streamed or hasattr(st.cpu, "submit_deferred")):
            # both sides in one CPU call (or one stream of the layer): in a prefill nearly every expert is on both
            # sides, and two calls read its weights twice (session 8: prefill with deferral at half the speed)
            both = _Partial(layer, st, hidden, torch.cat([topk_ids, later[0]], 1),
                            torch.cat([topk_weights, later[1]], 1), self.act, fused=self.fused, deferred=kd)
            self._inflight[layer] = (both, hidden, both.deferred_result())
            return
        self._inflight[layer] = (_Partial(layer, st, hidden, topk_ids, topk_weights, self.act, fused=self.fused),
                                 hidden, later)

    def _restart_if_interrupted(self, layer: int) -> None:
        if layer in self._inflight or any(d >= layer for d in self._deferred.layers()):
            self._deferred.discard()  # a new forward after an interrupted one
            for partial, _, _ in self._inflight.values():
                partial.join_cpu()
            self._inflight.clear()
            self._folded.clear()  # their CPU parts were joined when they were folded

    def _submit_fixed(self, layer, hidden, ids, weights, split, later, staged=(False, False)) -> None:
        """A fixed-shape step's layer (CUDA, handoff): its CPU part, then its deferred experts' CPU part,
        go to the CPU at once, in stream order, behind whatever the CPU still has queued (the previous
        layer's deferred experts); then both GPU parts. Nothing waits here: the layer's own part is
        joined in wait(), the deferred one where it joins the residual (after_layer of the next layer).
        split: route_split's split of (ids, weights), or None to split here. later: the deferred part's
        (ids, weights, part: its columns of them, None for all; route_split's split of that part, staged and started
        with the own part's go (merged_deferral), or None), or None without deferral. staged: _Partial's
        (route_split wrote the own part's rows to the handoff, and its go word)."""
        self._restart_if_interrupted(layer)
        st = self._layers[layer]
        parts = [_Partial(layer, st, hidden, ids, weights, self.act, self._handoff(False, layer, hidden), self.fused,
                          split, staged=staged)]
        if later is not None:
            later_ids, later_weights, part, merged = later
            parts.append(_Partial(layer, st, hidden, later_ids, later_weights, self.act,
                                  self._handoff(True, layer, hidden), self.fused, merged, part,
                                  (True, True) if merged is not None else (False, False)))
            self._deferred.add(layer, parts[1])
        for p in parts:
            p.start_gpu()
        # only behind a CPU part: the prefetch (~8 us for Qwen3's 38 MB) runs while the GPU would wait for it
        if self.prefetch_next and st.cpu is not None and layer in self._prefetch and HAVE_TRITON and hidden.is_cuda:
            from hybridmoe.layers.prefetch_triton import prefetch_l2

            prefetch_l2([m.weight for m in self._prefetch[layer]])
        # the previous layer's deferred part joins the residual with this layer's output (the same sum, in
        # another order): its output comes back while the GPU waits for this layer's CPU part anyway,
        # instead of a wait, a copy and an add after this layer
        folded = self._deferred.take_latest_before(layer)
        if folded is not None:
            folded.join_cpu()
            self._folded[layer] = folded
        self._inflight[layer] = (parts[0], hidden, None)

    def wait(self, layer):
        partial, hidden, later = self._inflight.pop(layer)
        out = partial.finish(self._folded.pop(layer, None))
        if isinstance(later, _DeferredOfPass):
            self._deferred.add(layer, later)
        elif later is not None:
            self._deferred.add(layer, _Partial(layer, self._layers[layer], hidden, *later, self.act, fused=self.fused))
        return out

    def after_layer(self, layer, hidden):
        return self._deferred.join(layer, hidden)
