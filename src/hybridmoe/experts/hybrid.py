"""The hybrid backend: each MoE layer's routed experts split between the GPU and the CPU engine.

Per layer, the experts the PlacementPlan puts on the GPU are stacked there (torch, the model's dtype; with
int4 / int8 CPU experts on CUDA, packed as the CPU engine packs them: gpu_format); the others go to the CPU
engine (native CpuExperts, or the torch reference on the CPU), which holds only those, renumbered
0..E_cpu-1. Each token's top-k is split by where its experts live; the two partial outputs are summed in
float32 (experts/hybrid_parts.py). With deferred_experts K, each token's K lowest-weighted experts run after
the layer's own, and their output joins the residual one decoder layer later (experts/deferral.py).
Experts with biases and the clamped SwiGLU (gpt-oss) split the same way: the GPU share keeps its experts' rows
of the biases and computes the model's activation (act), the CPU engine gets the other rows and the same
activation (set_layer_biases; the native engine's set_biases / set_glu).

Two paths run a step. The eager path (here): submit() starts the CPU part (native submit returns at once, the
workers run without the GIL) and then the GPU part; wait() joins them; a layer's own and deferred experts are
one CPU call with two outputs (submit_deferred: each expert's weights read once), the deferred output joining
one layer later. The fixed-shape path (experts/hybrid_fixed.py), on CUDA once use_fixed_shapes says yes, runs
short steps with no host sync through the CUDA handoffs, so that a CUDA graph captures them.

T tokens, K experts per token, H hidden, E experts, I expert intermediate size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.base import ExpertBackend, put_expert
from hybridmoe.experts.deferral import DeferredOutputs, split_deferred
from hybridmoe.experts.fp8_codes import dense_weights
from hybridmoe.experts.gpu_experts import weighted_experts
from hybridmoe.experts.hybrid_fixed import FixedShapeSteps
from hybridmoe.experts.hybrid_parts import DeferredOfPass, LayerSplit, Partial
from hybridmoe.experts.packed_gpu import pack_gpu_experts
from hybridmoe.experts.placement import PlacementPlan


class TorchCpuLayer:
    """The torch reference in the CPU engine's place: submit computes at once, wait returns float32 [T, H].
    act: an elementwise activation (act(gate) * up) or a ClampedSwiGLU (layers/clamped_swiglu.py)."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act=F.silu):
        self.gate, self.up, self.down, self.act = gate, up, down, act
        self.biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._out: torch.Tensor | None = None

    @property
    def num_experts(self) -> int:
        return self.gate.shape[0]

    def set_biases(self, gate_bias: torch.Tensor, up_bias: torch.Tensor, down_bias: torch.Tensor) -> None:
        """As CpuExperts.set_biases: gate/up [E, I], down [E, H] for later calls."""
        self.biases = (gate_bias, up_bias, down_bias)

    def _sum(self, x, ids, weights) -> torch.Tensor:
        return weighted_experts(x, self.gate, self.up, self.down, ids, weights, None, self.act, self.biases)

    def submit(self, x, ids, weights) -> None:
        self._out = self._sum(x, ids, weights)

    def submit_deferred(self, x, ids, weights, deferred: int) -> None:
        """As CpuExperts.submit_deferred: wait() returns (the first K - deferred slots' sum, the last deferred's)."""
        keep = ids.shape[1] - deferred
        self._out = tuple(self._sum(x, i, w) if i.shape[1] else torch.zeros(x.shape, dtype=torch.float32,
                                                                            device=x.device)
                          for i, w in ((ids[:, :keep], weights[:, :keep]), (ids[:, keep:], weights[:, keep:])))

    def wait(self) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        out, self._out = self._out, None
        return out


class HybridExperts(FixedShapeSteps, ExpertBackend):
    """Routed experts placed by a PlacementPlan: some on `device`, the rest in a CPU engine.

    cpu_layer(gate, up, down) builds the CPU engine of one layer from the CPU experts' stacked
    weights (CpuExperts with the engine options, or TorchCpuLayer); where it also has
    from_experts(experts, n), set_layer_experts packs the CPU experts one at a time through it. act: the GPU
    share's activation, the one cpu_layer gives its engines: an elementwise function (act(gate) * up), or the
    model's ClampedSwiGLU (gpt-oss).
    """

    def __init__(self, plan: PlacementPlan, device: str | torch.device, cpu_layer: Callable, act=F.silu,
                 deferred_experts: int = 0, num_layers: int = 0, gpu_format: str | None = None):
        self.plan, self.device, self.act = plan, torch.device(device), act
        self._cpu_layer = cpu_layer
        self.gpu_format = gpu_format
        """None: GPU experts stacked in the model's dtype (so with fp8 or mxfp4 CPU experts); "int4" / "int8": packed by
        cpu_layer (the native engine, in that format) and kept packed on the device (experts/packed_gpu.py;
        packed_gpu_format decides)."""
        self.deferred_experts = deferred_experts
        self._layers: dict[int, LayerSplit] = {}
        self._inflight: dict[int, tuple[Partial, torch.Tensor, tuple | None]] = {}
        self._deferred = DeferredOutputs(num_layers)
        self.fused = True  # the fixed-shape glue in one kernel each on CUDA (decode_fused.py); MoECausalLM.set_fused
        self._init_fixed_shapes()

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
        self._layers[layer] = LayerSplit(on_gpu, local, gpu, cpu, self.device)

    def takes_fp8_codes(self) -> bool:
        """Block-FP8 codes go to a native fp8 CPU engine as they are; the GPU's experts are dequantized to the
        model's dtype as they come (the GPU keeps no fp8 format: packed_gpu_format gives None for it)."""
        return getattr(self._cpu_layer, "format", None) == "fp8"

    def takes_mxfp4_codes(self) -> bool:
        """MXFP4 codes (gpt-oss) go to a native mxfp4 CPU engine as they are; the GPU's experts are dequantized to
        the model's dtype as they come, as fp8's are."""
        return getattr(self._cpu_layer, "format", None) == "mxfp4"

    def set_layer_biases(self, layer, gate_bias, up_bias, down_bias):
        """The layer's expert biases (gate/up [E, I], down [E, H]), after its experts: the GPU experts' rows stay on
        the device for the GPU share, the others go to the CPU engine (which holds its experts renumbered)."""
        st = self._layers[layer]
        biases = (gate_bias, up_bias, down_bias)
        gpu_ids = st.on_gpu_cpu.nonzero().flatten()
        cpu_ids = (~st.on_gpu_cpu).nonzero().flatten()
        if len(gpu_ids):
            st.gpu_biases = tuple(b.index_select(0, gpu_ids.to(b.device)).to(self.device) for b in biases)
        if st.cpu is not None:
            st.cpu_biases = tuple(b.index_select(0, cpu_ids.to(b.device)).cpu() for b in biases)
            st.cpu.set_biases(*st.cpu_biases)

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
                    put_expert(gpu, len(gpu_ids), gpu_slot[e], dense_weights(weights), self._gpu_staging)
                else:
                    yield weights

        from_experts = getattr(self._cpu_layer, "from_experts", None)
        if len(cpu_ids) and from_experts is not None:
            cpu = from_experts(cpu_experts(), len(cpu_ids))
        else:
            stacked: list[torch.Tensor] = []
            for i, weights in enumerate(cpu_experts()):
                put_expert(stacked, len(cpu_ids), i, dense_weights(weights), torch.device("cpu"))
            cpu = self._cpu_layer(*stacked) if stacked else None
        self._layers[layer] = LayerSplit(on_gpu, local, self._on_device(tuple(gpu)) if gpu else None, cpu, self.device)

    @property
    def _gpu_staging(self) -> torch.device:
        """Where a layer's GPU experts are stacked as they come: on the device, or on the CPU to be packed."""
        return torch.device("cpu") if self.gpu_format else self.device

    def _on_device(self, stacked: tuple[torch.Tensor, ...]) -> tuple:
        """A layer's GPU experts (gate, up, down), stacked in _gpu_staging, as the GPU share reads them."""
        if not self.gpu_format:
            return stacked

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
        (experts/streamed_prefill.py); None: every step's CPU share on the CPU engines. The CPU experts' biases,
        if any, go to the device with it (the packed bytes that stream hold none)."""
        for st in self._layers.values():
            st.streamer = streamer if st.cpu is not None else None
            on = st.streamer is not None and st.cpu_biases is not None
            st.streamed_biases = tuple(b.to(self.device) for b in st.cpu_biases) if on else None

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
            # sides, and two calls would read its weights twice
            both = Partial(layer, st, hidden, torch.cat([topk_ids, later[0]], 1),
                            torch.cat([topk_weights, later[1]], 1), self.act, fused=self.fused, deferred=kd)
            self._inflight[layer] = (both, hidden, both.deferred_result())
            return
        self._inflight[layer] = (Partial(layer, st, hidden, topk_ids, topk_weights, self.act, fused=self.fused),
                                 hidden, later)

    def _restart_if_interrupted(self, layer: int) -> None:
        if layer in self._inflight or any(d >= layer for d in self._deferred.layers()):
            self._deferred.discard()  # a new forward after an interrupted one
            for partial, _, _ in self._inflight.values():
                partial.join_cpu()
            self._inflight.clear()
            self._folded.clear()  # their CPU parts were joined when they were folded

    def wait(self, layer):
        partial, hidden, later = self._inflight.pop(layer)
        out = partial.finish(self._folded.pop(layer, None))
        if isinstance(later, DeferredOfPass):
            self._deferred.add(layer, later)
        elif later is not None:
            self._deferred.add(layer, Partial(layer, self._layers[layer], hidden, *later, self.act, fused=self.fused))
        return out

    def after_layer(self, layer, hidden):
        return self._deferred.join(layer, hidden)
