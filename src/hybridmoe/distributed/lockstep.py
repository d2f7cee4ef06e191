"""Rank 0's model as the engine drives it, with every other rank of the group making the same calls in lockstep.

Rank 0's engine schedules, samples and keeps the block table as it does in one process; its model runner calls
this model as it calls any (the runner runs every step eagerly: RankZeroExperts takes no fixed shapes). Each call
that runs collectives or touches the KV cache is first announced to the workers (distributed/messages.py): the
allocations of the caches, each forward (the step's token ids, positions, context and block table) and each
compute_logits (the hidden rows asked for); then rank 0 makes the call itself while the workers make it on their
shards. Everything else (parameters, the experts backend, the sizes the engine plans with) reads rank 0's model.
"""

from __future__ import annotations

import torch

from hybridmoe.distributed.messages import MIRRORED_METHODS, Allocate, Forward, Logits
from hybridmoe.forward_context import get_context


class LockstepModel:
    """model (rank 0's shard) with its collective calls mirrored on the workers; `workers` is the launcher's
    TensorParallelWorkers (in_lockstep, group)."""

    def __init__(self, model: torch.nn.Module, workers):
        self.model = model
        self._workers = workers

    def __getattr__(self, name: str):
        attribute = getattr(self.model, name)
        if name in MIRRORED_METHODS:
            return lambda *args, **kwargs: self._allocate(name, attribute, args, kwargs)
        return attribute

    def _allocate(self, name: str, method, args: tuple, kwargs: dict) -> None:
        with self._workers.in_lockstep(Allocate.of_call(name, args, kwargs)):
            method(*args, **kwargs)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The model's forward of the step in the current context, on every rank."""
        ctx = get_context()
        with self._workers.in_lockstep(Forward.of_step(input_ids, positions, ctx)):
            if ctx.block_table is not None:
                self._workers.group.broadcast(ctx.block_table.contiguous())
            return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, V] of hidden [N, H], on every rank (the output head's all-gather)."""
        hidden = hidden.contiguous()
        with self._workers.in_lockstep(Logits(tuple(hidden.shape), hidden.dtype)):
            return self.model.compute_logits(self._workers.group.broadcast(hidden))
