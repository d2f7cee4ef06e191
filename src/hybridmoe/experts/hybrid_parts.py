"""One MoE layer's split between the GPU and the CPU engine, and one submitted computation over it.

LayerSplit holds a layer's GPU experts and its CPU engine with the id maps; Partial is the one place a
layer's CPU work is started and joined, on the synchronous (eager) path or, given a CUDA handoff, in fixed
shapes (experts/hybrid_fixed.py); DeferredOfPass is the deferred experts' output of a Partial that computed
them in its own CPU call.

T tokens, K experts per token, H hidden, E experts.
"""

from __future__ import annotations

import torch

from hybridmoe.experts.cpu_slots import compact_slots, two_part_slots
from hybridmoe.experts.decode_fused import add_parts, split_slots, sum_parts
from hybridmoe.experts.gpu_experts import fixed_shape_experts, gpu_share


class LayerSplit:
    """One MoE layer's split: its GPU experts (stacked) and its CPU engine, with the id maps; for experts with
    biases (gpt-oss), the GPU experts' rows of them (the CPU engine holds its own)."""

    def __init__(self, on_gpu: torch.Tensor, local: torch.Tensor, gpu_weights, cpu, device):
        self.on_gpu_cpu = on_gpu  # [E] bool
        self.on_gpu = on_gpu.to(device)
        self.local_cpu = local  # [E] global id -> index among its side's experts
        self.local = local.to(device)
        self.gpu_weights = gpu_weights  # (gate, up, down) on the device (tensors, or PackedMatrix), or None
        self.cpu = cpu  # TorchCpuLayer / CpuExperts, or None
        self.streamer = None  # PrefillStreamer (experts/streamed_prefill.py): long steps' CPU share on the device
        self.gpu_biases = None  # (gate [G, I], up [G, I], down [G, H]) of the GPU experts, on the device, or None
        self.cpu_biases = None  # the CPU experts' rows, on the CPU (HybridExperts.set_layer_biases), or None
        self.streamed_biases = None  # cpu_biases on the device, while a streamer runs the CPU share there


class Partial:
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

    def __init__(self, layer: int, st: LayerSplit, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 act, handoff=None, fused: bool = False, split: tuple | None = None, part: tuple | None = None,
                 staged: tuple[bool, bool] = (False, False), deferred: int = 0):
        self.layer, self.device, self.dtype, self.shape = layer, hidden.device, hidden.dtype, hidden.shape
        self.fused = fused
        self.cpu, self.handoff, self.cpu_out, self.gpu_out = None, None, None, None
        self.deferred_cpu_out = self.deferred_gpu_out = None  # deferred: the deferred experts' parts
        self._gpu_share = None  # fixed shapes: the GPU share's arguments until start_gpu
        self._signaled = False  # fixed shapes: the kernels signal the handoff's flags (HybridTuning.kernel_flags)
        self._done = None  # then: the done word the kernel that reads cpu_out waits for (finish)
        if handoff is not None:
            self._start_fixed(st, hidden, ids, weights, act, *handoff, split, part, staged)
            return
        streamed = st.cpu is not None and st.streamer is not None and st.streamer.takes(hidden)
        if streamed:  # the streamer runs the GPU experts' slots too, in the same grouped kernels
            out = st.streamer.run(layer, hidden, st.local[ids], weights, ~st.on_gpu[ids], act, st.gpu_weights, deferred,
                                  st.streamed_biases, st.gpu_biases)
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
                self.deferred_gpu_out = gpu_share(hidden, *st.gpu_weights, local, weights, mask & ~own, act,
                                                  st.gpu_biases)
                mask = mask & own
            self.gpu_out = gpu_share(hidden, *st.gpu_weights, local, weights, mask, act, st.gpu_biases)

    def _start_fixed(self, st: LayerSplit, hidden, ids, weights, act, handoff, width: int, split=None, part=None,
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
            self._gpu_share = (hidden, *st.gpu_weights, local, weights, mask, act, st.gpu_biases)

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

    def finish(self, folded: Partial | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
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

    def deferred_result(self) -> DeferredOfPass:
        """The deferred experts' output (constructed with deferred), as a pending deferred computation."""
        return DeferredOfPass(self)


class DeferredOfPass:
    """The deferred experts of a Partial that computed them in its own CPU call (the synchronous path): their
    output joins the residual as a separate Partial's would (join_cpu, add_to)."""

    def __init__(self, owner: Partial):
        self.owner = owner

    def join_cpu(self) -> None:
        self.owner.join_cpu()

    def add_to(self, hidden: torch.Tensor) -> torch.Tensor:
        self.join_cpu()
        parts = [p.to(hidden.device) for p in (self.owner.deferred_cpu_out, self.owner.deferred_gpu_out)
                 if p is not None]
        return add_parts(hidden, parts, self.owner.fused) if parts else hidden + torch.zeros_like(hidden)
