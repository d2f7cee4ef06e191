"""What rank 0 and the other ranks of a tensor-parallel group tell each other over the pipe to each worker.

Rank 0 -> a worker: WorkerArgs once, then one message per model call of rank 0's engine that runs collectives or
touches the KV cache (Allocate, Forward, Logits), then Stop. A worker runs each as message.run(model, tp), the
same call on its own shard. The messages hold plain Python values only; the step's tensors (the block table, the
hidden rows whose logits are asked for) follow them over the process group, broadcast from rank 0, in the order
run() receives them.

A worker -> rank 0: ("joining", rank) before it joins the group, ("ready", RankReport) once its shard is loaded,
("error", one line) when it fails (it exits after).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from hybridmoe.config import EngineConfig
from hybridmoe.distributed.parallel_state import TensorParallel
from hybridmoe.errors import HybridMoEError
from hybridmoe.forward_context import Context, use_context


@dataclass(frozen=True)
class WorkerArgs:
    rank: int
    world_size: int
    init_file: Path
    """Where the group's members meet (parallel_state.join_group)."""
    model_dir: Path
    engine_config: EngineConfig
    load: Callable
    """load(model_dir, engine_config, tp) -> a loaded model (.model): the engine's loader, passed in so that this
    package never imports the engine."""
    threads: int
    """torch's intra-op threads in the worker: the host's cores shared among the ranks."""


@dataclass(frozen=True)
class RankReport:
    """What one rank holds once its shard is loaded."""

    rank: int
    parameter_bytes: int
    """Bytes of the model's parameters on this rank (its shard and what every rank holds whole)."""
    routed_expert_layers: list[int]
    """The MoE layers whose routed experts this rank's backend holds: every one on rank 0, none elsewhere."""


def rank_report(model: torch.nn.Module, rank: int) -> RankReport:
    return RankReport(rank, sum(p.numel() * p.element_size() for p in model.parameters()), model.experts.layers())


MIRRORED_METHODS = ("allocate_kv_cache", "allocate_kv_blocks", "allocate_state")
"""The model's methods that allocate its caches and states: each rank allocates its own, alike."""


@dataclass(frozen=True)
class Allocate:
    method: str
    """One of MIRRORED_METHODS."""
    args: tuple
    kwargs: dict

    @classmethod
    def of_call(cls, method: str, args: tuple, kwargs: dict) -> Allocate:
        if any(isinstance(v, torch.Tensor) for v in (*args, *kwargs.values())):
            raise HybridMoEError(f"{method} with a tensor argument does not run with tensor_parallel_size > 1")
        return cls(method, args, kwargs)

    def run(self, model, tp: TensorParallel) -> None:
        getattr(model, self.method)(*self.args, **self.kwargs)


_HOST_FIELDS = tuple(f.name for f in fields(Context) if f.name not in ("block_table", "decode"))
"""The step context's fields that are host values (the block table follows as a tensor)."""


@dataclass(frozen=True)
class Forward:
    """model(input_ids, positions) in the step's context."""

    input_ids: list[int]
    positions: list[int]
    context: dict
    """The context's host fields (_HOST_FIELDS)."""
    block_table: tuple[tuple[int, ...], torch.dtype] | None
    """The block table's shape and dtype (it follows, broadcast), or None: the caches' own slot tables."""

    @classmethod
    def of_step(cls, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Context) -> Forward:
        if ctx.decode is not None:
            raise HybridMoEError("fixed-shape decode steps do not run with tensor_parallel_size > 1")
        table = ctx.block_table
        return cls(input_ids.tolist(), positions.tolist(), {name: getattr(ctx, name) for name in _HOST_FIELDS},
                   None if table is None else (tuple(table.shape), table.dtype))

    def run(self, model, tp: TensorParallel) -> None:
        table = None
        if self.block_table is not None:
            shape, dtype = self.block_table
            table = tp.broadcast(torch.empty(shape, dtype=dtype, device=tp.device))
        with use_context(Context(**self.context, block_table=table)):
            model(torch.tensor(self.input_ids, dtype=torch.long, device=tp.device),
                  torch.tensor(self.positions, dtype=torch.long, device=tp.device))


@dataclass(frozen=True)
class Logits:
    """model.compute_logits(hidden) of rank 0's hidden rows (they follow, broadcast)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def run(self, model, tp: TensorParallel) -> None:
        model.compute_logits(tp.broadcast(torch.empty(self.shape, dtype=self.dtype, device=tp.device)))


@dataclass(frozen=True)
class Stop:
    """The worker leaves the group and exits."""
