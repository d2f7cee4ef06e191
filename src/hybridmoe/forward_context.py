"""Per-step metadata, set by the model runner before each forward and read by attention.

Keeping it here (not in forward's arguments) lets every model keep the signature
`forward(input_ids, positions)`.

Tokens of all sequences in a step are flattened: input_ids [T], positions [T], where
sequence b owns tokens cu_seqlens[b]:cu_seqlens[b+1]. Each sequence writes its keys and
values at positions start_pos[b] .. start_pos[b]+n_b-1 of the KV cache of slot slot_ids[b],
and attends to its positions 0 .. start_pos[b]+n_b-1 (causally). The cache is paged: slot s's
position p lives in block block_table[s, p // block_size] (engine/kv_blocks.py).

A decode step may also carry `decode` (DecodeBatch): the same batch as device tensors and one
padded length, so attention runs in shapes that do not depend on the lengths (CUDA graphs).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class DecodeBatch:
    """One new token per sequence, B rows, in fixed shapes: what a captured decode step reads."""

    slots: torch.Tensor
    """[B] long: KV-cache slot of each row."""

    lens: torch.Tensor
    """[B] long: cached length of each row after this step (its new token sits at lens - 1)."""

    pad_len: int
    """Cache positions every row attends over (at least each of lens; those past a row's length are masked)."""


@dataclass
class Context:
    slot_ids: list[int]
    """KV-cache slot of each sequence in the batch."""

    start_pos: list[int]
    """Tokens of each sequence already in its cache before this step."""

    cu_seqlens: list[int]
    """Prefix sums of new tokens per sequence: [0, n_0, n_0+n_1, ...]."""

    decode: DecodeBatch | None = None
    """Set for a decode step run in fixed shapes; attention then reads it instead of the lists."""

    block_table: torch.Tensor | None = None
    """[S, M] int32 on the step's device: row s lists the KV blocks of slot s's sequence. None: the cache's own
    table of contiguous slots (what allocate_kv_cache(num_slots, max_len) lays out)."""

    first_blocks: list[int | None] | None = None
    """Per sequence, where the host knows it: its first block when its blocks are consecutive (b, b + 1, ...),
    so attention reads its positions as one slice of the cache instead of gathering them; None: gather."""

    state_restores: list[tuple[int, int]] = field(default_factory=list)
    """(slot, snapshot): before the step, every layer with a recurrent state copies the snapshot's state into the
    slot (a sequence resuming after a cached prefix, engine/state_snapshots.py)."""

    state_saves: list[tuple[int, int, int]] = field(default_factory=list)
    """(sequence b, tokens of its new ones, snapshot): every layer with a recurrent state keeps b's state after that
    many of its new tokens in the snapshot (at most one per snapshot, each sequence's in increasing order)."""

    @property
    def num_seqs(self) -> int:
        return len(self.slot_ids)

    @property
    def is_decode(self) -> bool:
        """Every sequence brings exactly one new token."""
        return self.cu_seqlens[-1] == len(self.slot_ids)

    def seq_len(self, b: int) -> int:
        return self.cu_seqlens[b + 1] - self.cu_seqlens[b]

    def first_block(self, b: int) -> int | None:
        """first_blocks[b] where the context carries them, else None (gather)."""
        return self.first_blocks[b] if self.first_blocks is not None else None

    def slot_tensor(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(self.slot_ids, dtype=torch.long, device=device)


_CONTEXT: Context | None = None


def get_context() -> Context:
    if _CONTEXT is None:
        raise RuntimeError("no step context set: call the model inside use_context(...)")
    return _CONTEXT


@contextmanager
def use_context(ctx: Context):
    global _CONTEXT
    prev, _CONTEXT = _CONTEXT, ctx
    try:
        yield ctx
    finally:
        _CONTEXT = prev


def single_sequence_context(num_tokens: int, start_pos: int = 0, slot: int = 0) -> Context:
    """The context of one sequence: what tests and full recomputation use."""
    return Context(slot_ids=[slot], start_pos=[start_pos], cu_seqlens=[0, num_tokens])
