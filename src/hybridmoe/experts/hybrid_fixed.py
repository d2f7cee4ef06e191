"""The hybrid split's fixed-shape path: decode steps on CUDA in shapes fixed by their token count, with no host
sync, so that a CUDA graph captures the whole step, CPU experts included.

Once use_fixed_shapes(max_tokens) says yes (every CPU engine is native), a step of at most max_tokens tokens
sends its CPU share through a CUDA handoff (experts/cuda_handoff.py: rows out, the native engine run by the
handoff's polling thread, the output back, all ordered on the stream; rows and output through the device's
mapping of pinned buffers with zero_copy), submitted before the GPU share and waited for after it, and the
GPU share through fixed_shape_experts (experts/gpu_experts.py: Triton kernels that read only the routed
experts' weights). The glue around them (splitting the slots, summing the parts) is one Triton kernel each
(experts/decode_fused.py). With kernel_flags the router's kernel also writes the CPU's rows to the handoff
and its go word, and the kernel that sums the parts (and adds the residual) waits for the done word: between
two layers' CPU work the GPU runs kernels only; while the CPU works, the GPU prefetches the next layer's attention
and router weights into its L2 (tuning.prefetch_next, the modules the model handed prefetch_during). Deferred experts use a second handoff of their own width;
on the stream-memory-operations path the two are linked (CudaHandoff.link_deferred): the router's kernel
stages both parts and the CPU runs them as one call, which marks the own output done before it computes the
deferred experts, while the GPU goes on with the next layer.

FixedShapeSteps is a part of HybridExperts (experts/hybrid.py), which holds the layers and the eager path.
T tokens, K experts per token, H hidden.
"""

from __future__ import annotations

import logging

import torch

from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.cpu_experts import CpuExperts
from hybridmoe.experts.cuda_handoff import CudaHandoff, pinned
from hybridmoe.experts.decode_fused import route_split
from hybridmoe.experts.hybrid_parts import Partial
from hybridmoe.experts.tuning import HybridTuning
from hybridmoe.platform import HAVE_TRITON

log = logging.getLogger("hybridmoe.experts")


class FixedShapeSteps:
    """HybridExperts' fixed-shape path (it reads the layers, in-flight parts and deferred outputs HybridExperts
    keeps): making the handoffs, and routing, submitting and joining a step's layers in fixed shapes."""

    def _init_fixed_shapes(self) -> None:
        self.tuning = HybridTuning()
        self._fixed_tokens = 0  # steps of at most this many tokens run in fixed shapes (use_fixed_shapes)
        self._fixed_dtype = torch.float32  # the hidden states' dtype use_fixed_shapes was given
        self._handoffs: dict[tuple[bool, int], tuple] = {}  # (deferred?, layer) -> (CudaHandoff, width)
        self._folded: dict[int, Partial] = {}  # layer -> the deferred part joining its output
        self._merged: set[int] = set()  # layers whose own and deferred handoffs use_fixed_shapes linked
        self._driver_cpus: set[int] = set()  # the CPUs the handoffs' pools leave free (use_fixed_shapes)
        self._prefetch: dict[int, list] = {}  # layer -> modules whose .weight to prefetch (prefetch_during)

    def use_fixed_shapes(self, max_tokens: int, dtype: torch.dtype) -> bool:
        """On CUDA, run steps of at most max_tokens tokens in fixed shapes from now on (CUDA-graph
        capturable); dtype: the hidden states'. False, and nothing changes, when the device is not
        CUDA or a layer's CPU engine is not the native one (the handoff runs only that)."""
        if self.device.type != "cuda":
            return False
        cpu = {layer: st.cpu for layer, st in self._layers.items() if st.cpu is not None}
        if not all(isinstance(c, CpuExperts) for c in cpu.values()):
            return False
        if cpu:
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
                    # no CPU work at all): 1.06x decode on a DeepSeek-V2-Lite int4 model.
                    handoff.trim_padding = True
                    handoff.zero_copy = self.tuning.zero_copy and HAVE_TRITON
                    handoffs.update({(deferred, layer): (handoff, width) for layer in layers})
            except HybridMoEError as e:  # no usable CUDA runtime: the synchronous path still works
                log.warning("CPU experts run without the CUDA handoff (and decode steps without CUDA graphs): %s", e)
                return False
            self._handoffs = handoffs
            self._driver_cpus = set.intersection(*(h.driver_cpus for h, _ in handoffs.values()))
            self._merged = set()
            if self.deferred_experts and self.tuning.kernel_flags and HAVE_TRITON:
                for layer in cpu:
                    own, later = handoffs.get((False, layer)), handoffs.get((True, layer))
                    if own and later and own[0].zero_copy and own[0].path == later[0].path == "stream_mem_ops":
                        own[0].link_deferred(layer, later[0])
                        self._merged.add(layer)
        self._fixed_tokens, self._fixed_dtype = max_tokens, dtype
        return True

    def prefetch_during(self, layer: int, modules: list) -> None:
        """While layer's CPU part runs (tuning.prefetch_next), prefetch up to three modules' .weight into the GPU's
        L2 (read when a step is enqueued: the modules may get their weights after this call)."""
        if not 1 <= len(modules) <= 3:
            raise HybridMoEError(f"prefetch_during takes one to three modules, got {len(modules)}")
        self._prefetch[layer] = list(modules)

    def decode_thread(self):
        """A context for a fixed-shape step, around its launch and the wait for its result: the calling
        thread (which drives the GPU and spins in CUDA's waits) runs on the CPUs the CUDA handoffs' pools
        leave free (cuda_handoff.pinned), unless pin_decode_thread is False or none is free."""
        return pinned(self._driver_cpus if self.tuning.pin_decode_thread else set())

    def wait_step(self, done: torch.cuda.Event) -> None:
        """Wait for a fixed-shape step's event `done` (recorded after its tokens' copy). With help_decode_wait,
        a pinned decode thread (decode_thread) and a polling handoff, the thread first works in the handoffs'
        pool as one more worker until the event completes (CudaHandoff.help_until): the handoff pools leave its
        CPU free for it, and spinning in CUDA's wait would leave that CPU out of the layers."""
        if self.tuning.help_decode_wait and self.tuning.pin_decode_thread and self._driver_cpus:
            polling = next((h for h, _ in self._handoffs.values() if h.path == "stream_mem_ops"), None)
            if polling is not None:
                polling.help_until(done)
        done.synchronize()

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
        if st.cpu is not None and self.tuning.kernel_flags and handoff.zero_copy:
            rows = handoff.staging(layer, T)
            stage = (hidden, rows.x, rows.ids, rows.weights)
            signal = handoff.flag_words(layer) if handoff.path == "stream_mem_ops" else None
        if signal is not None and kd and layer in self._merged:
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

    def _submit_fixed(self, layer, hidden, ids, weights, split, later, staged=(False, False)) -> None:
        """A fixed-shape step's layer (CUDA, handoff): its CPU part, then its deferred experts' CPU part,
        go to the CPU at once, in stream order, behind whatever the CPU still has queued (the previous
        layer's deferred experts); then both GPU parts. Nothing waits here: the layer's own part is
        joined in wait(), the deferred one where it joins the residual (after_layer of the next layer).
        split: route_split's split of (ids, weights), or None to split here. later: the deferred part's
        (ids, weights, part: its columns of them, None for all; route_split's split of that part, staged and started
        with the own part's go (linked handoffs), or None), or None without deferral. staged: Partial's
        (route_split wrote the own part's rows to the handoff, and its go word)."""
        self._restart_if_interrupted(layer)
        st = self._layers[layer]
        parts = [Partial(layer, st, hidden, ids, weights, self.act, self._handoff(False, layer, hidden), self.fused,
                          split, staged=staged)]
        if later is not None:
            later_ids, later_weights, part, merged = later
            parts.append(Partial(layer, st, hidden, later_ids, later_weights, self.act,
                                  self._handoff(True, layer, hidden), self.fused, merged, part,
                                  (True, True) if merged is not None else (False, False)))
            self._deferred.add(layer, parts[1])
        for p in parts:
            p.start_gpu()
        # only behind a CPU part: the prefetch (~8 us for Qwen3's 38 MB) runs while the GPU would wait for it
        if self.tuning.prefetch_next and st.cpu is not None and layer in self._prefetch and HAVE_TRITON:
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

