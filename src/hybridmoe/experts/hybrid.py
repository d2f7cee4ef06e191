"""The hybrid backend: each MoE layer's routed experts split between the GPU and the CPU engine.

Per layer, the experts the PlacementPlan puts on the GPU are stacked there (torch, the model's
dtype); the others go to the CPU engine (native CpuExperts, or the torch reference on the CPU),
which holds only those, renumbered 0..E_cpu-1. Each token's top-k is split by where its experts
live; the two partial outputs are summed in float32. submit() starts the CPU part (native submit
returns at once, the workers run without the GIL) and then the GPU part; wait() joins them.
With deferred_experts K, each token's K lowest-weighted experts run after the layer's own, and
their output joins the residual one decoder layer later (experts/deferral.py).

T tokens, K experts per token, H hidden, E experts, I expert intermediate size.
Hooks for the CUDA handoff: `_Partial` is the one place a layer's CPU work is started (cpu.submit)
and joined (cpu.wait); D2H of (x, ids, weights) and H2D of the result happen there too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from hybridmoe.experts.base import ExpertBackend
from hybridmoe.experts.deferral import DeferredOutputs, split_deferred
from hybridmoe.experts.placement import PlacementPlan


def weighted_experts(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                     ids: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor | None, act) -> torch.Tensor:
    """sum over slots with mask of weights * expert_ids(x), as TorchExperts computes it; float32 [T, H].

    x [T, H]; gate, up [E, I, H]; down [E, H, I]; ids [T, K] (local to these E); weights [T, K];
    mask [T, K] bool (None: every slot).
    """
    xw = x.to(gate.dtype)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    ids = ids.long() if mask is None else torch.where(mask, ids.long(), -1)
    for e in torch.unique(ids).tolist():
        if e < 0:
            continue
        tok, slot = (ids == e).nonzero(as_tuple=True)
        xe = xw[tok]
        ye = F.linear(act(F.linear(xe, gate[e])) * F.linear(xe, up[e]), down[e])
        out.index_add_(0, tok, ye.float() * weights[tok, slot].float().unsqueeze(1))
    return out


def fixed_shape_experts(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                        ids: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor, act) -> torch.Tensor:
    """weighted_experts' sum with shapes that depend on T, K and E only: no host sync, capturable.

    Masked-out slots compute expert 0 with weight 0. When T * K < E each slot gathers its expert's
    weights (reads T * K experts: decode); otherwise every expert runs on every token (reads each
    expert once) and a dense [T, E] weight matrix picks the sum. Same arguments as weighted_experts.
    """
    T, K = ids.shape
    E = gate.shape[0]
    xw = x.to(gate.dtype)
    w = torch.where(mask, weights.float(), 0.0)  # [T, K]
    ids = torch.where(mask, ids.long(), 0)
    if T * K < E:
        xs = xw[:, None, :, None]  # [T, 1, H, 1]
        h = act(gate[ids] @ xs) * (up[ids] @ xs)  # [T, K, I, 1]
        y = (down[ids] @ h).squeeze(-1)  # [T, K, H]
        return (y.float() * w.unsqueeze(-1)).sum(dim=1)
    xt = xw.t()  # [H, T]
    h = act(gate @ xt) * (up @ xt)  # [E, I, T]
    y = down @ h  # [E, H, T]
    dense = torch.zeros(T, E, dtype=torch.float32, device=x.device).scatter_add_(1, ids, w)  # [T, E]
    return torch.einsum("te,eht->th", dense, y.float())


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

    def wait(self) -> torch.Tensor:
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


class _Layer:
    """One MoE layer's split: its GPU experts (stacked) and its CPU engine, with the id maps."""

    def __init__(self, on_gpu: torch.Tensor, local: torch.Tensor, gpu_weights, cpu, device):
        self.on_gpu_cpu = on_gpu  # [E] bool
        self.on_gpu = on_gpu.to(device)
        self.local_cpu = local  # [E] global id -> index among its side's experts
        self.local = local.to(device)
        self.gpu_weights = gpu_weights  # (gate, up, down) on the device, or None
        self.cpu = cpu  # TorchCpuLayer / CpuExperts, or None


class _Partial:
    """One submitted computation (a layer's experts, or its deferred ones): CPU part in flight + GPU part."""

    def __init__(self, st: _Layer, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, act):
        self.device, self.dtype, self.shape = hidden.device, hidden.dtype, hidden.shape
        self.cpu, self.cpu_out, self.gpu_out = None, None, None
        if st.cpu is not None:
            ids_c, w_c = ids.cpu(), weights.float().cpu()
            dense = compact_slots(st.local_cpu[ids_c], w_c, ~st.on_gpu_cpu[ids_c])
            if dense is not None:
                native_dtype = torch.bfloat16 if hidden.dtype == torch.float16 else hidden.dtype
                st.cpu.submit(hidden.to("cpu", native_dtype), *dense)
                self.cpu = st.cpu
        if st.gpu_weights is not None:
            mask = st.on_gpu[ids]
            if bool(mask.any()):
                self.gpu_out = weighted_experts(hidden, *st.gpu_weights, st.local[ids], weights, mask, act)

    def join_cpu(self) -> None:
        if self.cpu is not None:
            self.cpu_out, self.cpu = self.cpu.wait(), None

    def finish(self) -> torch.Tensor:
        """[T, H] in the hidden state's dtype and device."""
        self.join_cpu()
        parts = [p for p in (self.cpu_out, self.gpu_out) if p is not None]
        if not parts:
            return torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        out = parts[0].to(self.device, torch.float32)
        for p in parts[1:]:
            out = out + p.to(self.device, torch.float32)
        return out.to(self.dtype)


class HybridExperts(ExpertBackend):
    """Routed experts placed by a PlacementPlan: some on `device`, the rest in a CPU engine.

    cpu_layer(gate, up, down) builds the CPU engine of one layer from the CPU experts' stacked
    weights (CpuExperts with the engine options, or TorchCpuLayer).
    """

    def __init__(self, plan: PlacementPlan, device: str | torch.device, cpu_layer: Callable, act=F.silu,
                 deferred_experts: int = 0, num_layers: int = 0):
        self.plan, self.device, self.act = plan, torch.device(device), act
        self._cpu_layer = cpu_layer
        self.deferred_experts = deferred_experts
        self._layers: dict[int, _Layer] = {}
        self._inflight: dict[int, tuple[_Partial, torch.Tensor, tuple | None]] = {}
        self._deferred = DeferredOutputs(num_layers)

    def set_layer(self, layer, gate_proj, up_proj, down_proj):
        E = gate_proj.shape[0]
        gpu_ids = torch.tensor(self.plan.on_gpu(layer), dtype=torch.long)
        on_gpu = torch.zeros(E, dtype=torch.bool)
        on_gpu[gpu_ids] = True
        cpu_ids = (~on_gpu).nonzero().flatten()
        local = torch.empty(E, dtype=torch.long)
        local[gpu_ids] = torch.arange(len(gpu_ids))
        local[cpu_ids] = torch.arange(len(cpu_ids))
        # index_select copies: the GPU side gets only its experts, the CPU engine only the others
        gpu = None
        if len(gpu_ids):
            gpu = tuple(w.index_select(0, gpu_ids.to(w.device)).to(self.device)
                        for w in (gate_proj, up_proj, down_proj))
        cpu = None
        if len(cpu_ids):
            cpu = self._cpu_layer(*(w.index_select(0, cpu_ids.to(w.device)).cpu()
                                    for w in (gate_proj, up_proj, down_proj)))
        self._layers[layer] = _Layer(on_gpu, local, gpu, cpu, self.device)

    def layers(self):
        return sorted(self._layers)

    def gpu_experts(self, layer: int) -> list[int]:
        return self.plan.on_gpu(layer)

    def cpu_engine(self, layer: int):
        """The CPU engine of layer (it holds only that layer's CPU experts), or None if all are on the GPU."""
        return self._layers[layer].cpu

    def submit(self, layer, hidden, topk_ids, topk_weights):
        if layer in self._inflight or any(d >= layer for d in self._deferred.layers()):
            self._deferred.discard()  # a new forward after an interrupted one
            for partial, _, _ in self._inflight.values():
                partial.join_cpu()
            self._inflight.clear()
        # the CPU finishes the previous layer's deferred experts before this layer's own
        self._deferred.drain_cpu()
        later = None
        if self.deferred_experts:
            topk_ids, topk_weights, *later = split_deferred(topk_ids, topk_weights, self.deferred_experts)
        st = self._layers[layer]
        self._inflight[layer] = (_Partial(st, hidden, topk_ids, topk_weights, self.act), hidden, later)

    def wait(self, layer):
        partial, hidden, later = self._inflight.pop(layer)
        out = partial.finish()
        if later is not None:
            self._deferred.add(layer, _Partial(self._layers[layer], hidden, *later, self.act))
        return out

    def after_layer(self, layer, hidden):
        return self._deferred.join(layer, hidden)
