"""Which routed experts live on the GPU, decided from tensor sizes before any weight is read.

The GPU holds everything but the routed experts (embeddings, attention, norms, routers, dense
layers, shared experts, lm_head), the paged KV cache (kv_plan.py) and a
workspace margin; that must fit the budget, else a HybridMoEError says how much is needed. What
is left fills with routed experts, chosen by a policy:

- "uniform": the same count n in every MoE layer;
- "frequency": the (layer, expert) pairs with the most routed tokens in a profile, any layer;
- "front-loading": whole layers, from the first MoE layer on (the last one partly);
- gpu_experts_per_layer N: N in every layer (an error if a budget is set and N does not fit).

Within a layer the hottest experts of the profile go first (without a profile: the lowest ids,
as good as any for a router trained to balance). A plan never exceeds its budget.

L MoE layers, E routed experts per layer, K experts per token, H hidden, I expert intermediate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridmoe.config import EngineConfig, format_bytes
from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.expert_bytes import packed_expert_bytes
from hybridmoe.experts.packed_gpu import packed_gpu_format
from hybridmoe.experts.streamed_prefill import reserved_bytes as prefill_streaming_bytes
from hybridmoe.experts.torch_ref import TorchExperts
from hybridmoe.kv_plan import KVPlan, plan_kv_cache

POLICIES = ("uniform", "frequency", "front-loading")
STATS_FORMAT = "hybridmoe-expert-stats"

WORKSPACE_FIXED_BYTES = 256 << 20
"""Allocator slack and library workspaces (cuBLAS), whatever the batch."""

WORKSPACE_ROW_FLOATS = 16
"""float32 rows of the widest activation each batched token may hold at once (residual, norms,
q/k/v, gate/up, partial expert sums, the CPU experts' result): a conservative estimate, to be
checked against torch.cuda.max_memory_allocated on a GPU."""


def gpu_expert_format(engine_config: EngineConfig, dtype: torch.dtype) -> str | None:
    """The packed format the GPU's routed experts are kept in (experts/packed_gpu.py), or None: the model's dtype."""
    return packed_gpu_format(engine_config.expert_backend, engine_config.expert_format, engine_config.device, dtype,
                             engine_config.gpu_experts_packed)


@dataclass
class Footprint:
    """A model's GPU memory, from its tensor sizes (nothing allocated)."""

    non_expert_bytes: int
    """Every parameter and buffer of the model but the routed experts, in the compute dtype."""
    kv_cache_bytes: int
    """The paged KV cache (kv_plan.py)."""
    workspace_bytes: int
    expert_bytes: int
    """One routed expert (gate + up + down) on the GPU: in the compute dtype, or packed (gpu_expert_format); with
    its biases in the compute dtype where the model has them."""
    moe_layers: list[int]
    num_experts: int
    top_k: int
    hidden_size: int
    moe_intermediate_size: int
    gpu_format: str | None = None
    """The packed format of the GPU's routed experts (gpu_expert_format), None: the compute dtype."""
    kv_plan: KVPlan | None = None
    """The KV cache's blocks and the max_model_len they give (kv_cache_bytes is its size)."""

    @property
    def fixed_bytes(self) -> int:
        return self.non_expert_bytes + self.kv_cache_bytes + self.workspace_bytes


def model_footprint(model_cls, config, dtype: torch.dtype, engine_config: EngineConfig) -> Footprint:
    """Build the model on the meta device (no memory) and add up what it would hold."""
    with torch.device("meta"):
        model = model_cls(config, TorchExperts()).to(dtype)
    model.tie_weights()
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    non_expert = sum(t.numel() * t.element_size() for t in tensors.values())
    kv_plan = plan_kv_cache(config, engine_config, model.kv_bytes_per_token(engine_config.kv_cache_dtype == "fp8"),
                            state_bytes_per_seq=model.state_bytes_per_seq())
    E, inter = model.expert_dims()
    H = config.hidden_size
    widest = max(H, config.get("intermediate_size") or 0, inter * config.num_experts_per_tok)
    workspace = (WORKSPACE_FIXED_BYTES + engine_config.max_num_batched_tokens * WORKSPACE_ROW_FLOATS * widest * 4
                 + 2 * engine_config.max_num_seqs * config.vocab_size * 4
                 + prefill_streaming_bytes(engine_config, E, H, inter, config.num_experts_per_tok))
    packed = gpu_expert_format(engine_config, dtype)
    expert_bytes = (packed_expert_bytes(packed, H, inter, engine_config.expert_group_size_or_default,
                                        bool(engine_config.expert_zero_points)) if packed
                    else 3 * inter * H * torch.finfo(dtype).bits // 8)
    if config.get("expert_bias"):  # gate, up [I] and down [H] in the compute dtype (gpt-oss)
        expert_bytes += (2 * inter + H) * torch.finfo(dtype).bits // 8
    return Footprint(non_expert_bytes=non_expert, kv_cache_bytes=kv_plan.bytes, workspace_bytes=workspace,
                     expert_bytes=expert_bytes, moe_layers=model.moe_layers,
                     num_experts=E, top_k=config.num_experts_per_tok, hidden_size=H, moe_intermediate_size=inter,
                     gpu_format=packed, kv_plan=kv_plan)


@dataclass
class ExpertStats:
    """Routed-token counts per MoE layer per expert, from `hybridmoe profile-experts`."""

    counts: dict[int, list[int]]
    tokens: int = 0

    def to_json(self, **extra) -> str:
        """The file `hybridmoe profile-experts` writes: one line per layer's counts."""
        head = json.dumps({"format": STATS_FORMAT, "version": 1, **extra, "tokens": self.tokens})
        rows = ",\n".join(f'  "{layer}": {json.dumps(c)}' for layer, c in sorted(self.counts.items()))
        return f'{head[:-1]}, "counts": {{\n{rows}\n}}}}'

    @classmethod
    def load(cls, path: str | Path, moe_layers: list[int], num_experts: int) -> ExpertStats:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HybridMoEError(f"cannot read expert statistics {path} ({e})") from None
        if not isinstance(raw, dict) or raw.get("format") != STATS_FORMAT:
            raise HybridMoEError(f"{path} is not an expert statistics file; write one with `hybridmoe profile-experts`")
        counts = {int(k): v for k, v in raw.get("counts", {}).items()}
        if sorted(counts) != sorted(moe_layers) or any(len(v) != num_experts for v in counts.values()):
            raise HybridMoEError(f"{path} was recorded for another model (its layers or expert counts differ); "
                                 "profile this model with `hybridmoe profile-experts`")
        return cls(counts, int(raw.get("tokens", 0)))

    def hottest(self, layer: int) -> list[int]:
        """Expert ids of layer, most routed first (ties: lower id first)."""
        c = self.counts[layer]
        return sorted(range(len(c)), key=lambda e: (-c[e], e))


@dataclass
class PlacementPlan:
    footprint: Footprint
    budget: int | None
    policy: str
    gpu_experts: dict[int, list[int]] = field(default_factory=dict)
    """MoE layer -> ids of its routed experts on the GPU, ascending."""

    def on_gpu(self, layer: int) -> list[int]:
        return self.gpu_experts.get(layer, [])

    def on_cpu(self, layer: int) -> list[int]:
        gpu = set(self.on_gpu(layer))
        return [e for e in range(self.footprint.num_experts) if e not in gpu]

    @property
    def num_gpu_experts(self) -> int:
        return sum(len(v) for v in self.gpu_experts.values())

    @property
    def gpu_bytes(self) -> int:
        """What the GPU holds under this plan: fixed part + the resident routed experts."""
        return self.footprint.fixed_bytes + self.num_gpu_experts * self.footprint.expert_bytes

    def cpu_experts_per_token(self, stats: ExpertStats | None = None) -> float:
        """Expected routed experts one token reads on the CPU, over all MoE layers."""
        fp, total = self.footprint, 0.0
        for layer in fp.moe_layers:
            gpu = self.on_gpu(layer)
            if stats is not None and sum(stats.counts[layer]):
                c = stats.counts[layer]
                share = sum(c[e] for e in gpu) / sum(c)
            else:
                share = len(gpu) / fp.num_experts
            total += fp.top_k * (1.0 - share)
        return total

    def describe(self) -> str:
        fp = self.footprint
        per_layer = sorted({len(self.on_gpu(layer)) for layer in fp.moe_layers})
        counts = (f"{per_layer[0]}" if len(per_layer) == 1 else f"{per_layer[0]}..{per_layer[-1]}")
        budget = format_bytes(self.budget) if self.budget is not None else "none"
        return (f"{self.policy}: {self.num_gpu_experts} of {fp.num_experts * len(fp.moe_layers)} routed "
                f"experts on the GPU ({counts} per MoE layer, {format_bytes(fp.expert_bytes)} each"
                f"{', packed ' + fp.gpu_format if fp.gpu_format else ''}); GPU "
                f"{format_bytes(self.gpu_bytes)} of budget {budget} = non-expert weights "
                f"{format_bytes(fp.non_expert_bytes)} + KV cache {format_bytes(fp.kv_cache_bytes)} + workspace "
                f"{format_bytes(fp.workspace_bytes)} + experts "
                f"{format_bytes(self.num_gpu_experts * fp.expert_bytes)}")


def plan_placement(fp: Footprint, engine_config: EngineConfig, stats: ExpertStats | None = None) -> PlacementPlan:
    """The routed experts to keep on the GPU under engine_config's budget and policy."""
    budget = engine_config.gpu_memory_budget
    policy = engine_config.expert_placement
    if budget is not None and fp.fixed_bytes > budget:
        raise HybridMoEError(
            f"gpu_memory_budget {format_bytes(budget)} is too small: non-expert weights "
            f"{format_bytes(fp.non_expert_bytes)} + KV cache {format_bytes(fp.kv_cache_bytes)} + workspace "
            f"{format_bytes(fp.workspace_bytes)} need {format_bytes(fp.fixed_bytes)} ({fp.fixed_bytes} bytes); "
            "raise --gpu-memory-budget or lower --max-num-seqs / --max-model-len")
    L, E = fp.moe_layers, fp.num_experts
    slots = None if budget is None else (budget - fp.fixed_bytes) // fp.expert_bytes

    def hottest(layer: int) -> list[int]:
        return stats.hottest(layer) if stats is not None else list(range(E))

    n_fixed = engine_config.gpu_experts_per_layer
    if n_fixed is not None:
        if n_fixed > E:
            raise HybridMoEError(f"gpu_experts_per_layer {n_fixed} exceeds the {E} routed experts per layer")
        if slots is not None and n_fixed * len(L) > slots:
            raise HybridMoEError(
                f"gpu_experts_per_layer {n_fixed} needs {format_bytes(n_fixed * len(L) * fp.expert_bytes)} of "
                f"experts but the budget leaves {format_bytes(budget - fp.fixed_bytes)} (room for "
                f"{slots // max(len(L), 1)} per layer); lower it or raise --gpu-memory-budget")
        chosen = {layer: hottest(layer)[:n_fixed] for layer in L}
        policy = f"{n_fixed} per layer"
    elif slots is None or not L:
        chosen = {}
    elif policy == "uniform":
        chosen = {layer: hottest(layer)[:min(E, slots // len(L))] for layer in L}
    elif policy == "front-loading":
        chosen, left = {}, slots
        for layer in L:
            chosen[layer], left = hottest(layer)[:min(E, left)], left - min(E, left)
    elif policy == "frequency":
        if stats is None:
            raise HybridMoEError("expert_placement 'frequency' needs routing statistics: run `hybridmoe "
                                 "profile-experts --model DIR --prompts FILE --out stats.json` and pass "
                                 "--expert-stats stats.json")
        pairs = sorted(((layer, e) for layer in L for e in range(E)),
                       key=lambda p: (-stats.counts[p[0]][p[1]], p[0], p[1]))
        chosen = {}
        for layer, e in pairs[:slots]:
            chosen.setdefault(layer, []).append(e)
    else:
        raise HybridMoEError(f"expert_placement must be one of {', '.join(POLICIES)}, got {policy!r}")
    return PlacementPlan(fp, budget, policy, {layer: sorted(ids) for layer, ids in chosen.items() if ids})


def placement_for(model_cls, config, dtype: torch.dtype, engine_config: EngineConfig
                  ) -> tuple[PlacementPlan, ExpertStats | None]:
    """The plan for a model under engine_config, and the routing statistics it used (if any)."""
    fp = model_footprint(model_cls, config, dtype, engine_config)
    stats = None
    if engine_config.expert_stats:
        stats = ExpertStats.load(engine_config.expert_stats, fp.moe_layers, fp.num_experts)
    return plan_placement(fp, engine_config, stats), stats
