"""Continuous batching with chunked prefill over a paged KV cache.

A running sequence holds a slot (its row of the block table, and of the fixed-shape decode step's inputs) and
the KV blocks its computed tokens fill (engine/kv_blocks.py). Every step runs one token of each decoding
sequence first, then spends what is left of the token budget on prompt chunks (sequences already prefilling
first, then new arrivals in order), so a long prompt is prefilled across several steps while the other streams
keep decoding. A new arrival first takes the cached blocks of its longest cached prefix and starts computing
after them.

When the pool runs out of blocks, the most recently admitted running sequence that this step has not scheduled
yet is preempted (or, if none is left, the one asking): its blocks go back to the pool and it waits at the front
of the queue with every token it has so far, to be computed again when it is readmitted; its full blocks stay
in the prefix cache until they are evicted, so that usually means finding them again. Its output continues as
if it had never stopped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from hybridmoe.engine.kv_blocks import BlockPool, SequenceBlocks, TokenDigests
from hybridmoe.engine.sequence import Sequence, SequenceStatus

LOOKAHEAD_TOKENS = 1
"""Positions a decoding sequence holds blocks for beyond this step's token, when the pool has them: the
fixed-shape decode step launched ahead (engine/model_runner.py) writes there."""


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int
    """Tokens of seq run this step: positions num_computed .. num_computed + num_tokens - 1."""

    @property
    def completes(self) -> bool:
        """After this step every token of seq is in the cache, so its next token is sampled."""
        return self.seq.num_computed + self.num_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, num_slots: int, max_num_batched_tokens: int, pool: BlockPool):
        self.max_num_batched_tokens = max_num_batched_tokens
        self.pool = pool
        self.free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def admits(self) -> bool:
        """The next schedule() may admit a waiting sequence (one waits and a slot is free)."""
        return bool(self.waiting and self.free_slots)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        for seq in [s for s in self.running if s.num_uncomputed == 1]:  # decoding streams never stall
            if seq.status is SequenceStatus.RUNNING and self._grow(seq, 1, batch):
                self._grow(seq, 1 + LOOKAHEAD_TOKENS, batch, preempt=False)
                batch.append(ScheduledSeq(seq, 1))
                budget -= 1
        for seq in [s for s in self.running if s.num_uncomputed > 1]:
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            room = self._room(seq)  # what the free blocks hold, or else one block's worth, made room for by preemption
            n = min(seq.num_uncomputed, budget, room if room > 0 else self.pool.block_size)
            if self._grow(seq, n, batch):
                batch.append(ScheduledSeq(seq, n))
                budget -= n
        while self.waiting and self.free_slots and budget > 0:
            n = self._admit(self.waiting[0], budget)
            if n == 0:
                break
            seq = self.waiting.popleft()
            batch.append(ScheduledSeq(seq, n))
            budget -= n
        return batch

    def cache_computed(self, seq: Sequence) -> None:
        """After a step: register the blocks seq's computed tokens filled, for later requests to find."""
        if self.pool.prefix_caching and seq.num_computed // self.pool.block_size > len(seq.blocks.digests):
            self.pool.register(seq.blocks, self._digests(seq), seq.num_computed)

    def finish(self, seq: Sequence) -> None:
        """Take seq out of the schedule and free its slot and blocks (finished or aborted)."""
        if seq.status is SequenceStatus.RUNNING:
            self._release(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Give the first waiting sequence a slot, its cached prefix and blocks for its first chunk; the
        chunk's tokens, or 0 (nothing taken) when the pool cannot hold any."""
        found, digests = self.pool.match_prefix(self._digests(seq), seq.num_tokens - 1)
        held = self.pool.take(found, digests)
        cached = len(held) * self.pool.block_size
        n = min(seq.num_uncomputed - cached, budget,
                (len(held) + self.pool.num_free) * self.pool.block_size - cached)
        fresh = self.pool.allocate(self.pool.blocks_for(cached + n) - len(held)) if n > 0 else None
        if fresh is None:
            self.pool.release(held)
            return 0
        seq.blocks = SequenceBlocks(held + fresh, digests[:len(held)])
        seq.num_computed = cached
        if seq.num_preemptions == 0:  # a request's first admission: what /metrics counts, what usage reports
            seq.num_cached_tokens = cached
            self.pool.stats.queried_tokens += seq.num_tokens
            self.pool.stats.hit_tokens += cached
        seq.slot = self.free_slots.pop()
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return n

    def _digests(self, seq: Sequence) -> TokenDigests:
        if seq.block_digests is None:
            seq.block_digests = TokenDigests(seq.token_ids, self.pool.block_size)
        return seq.block_digests

    def _room(self, seq: Sequence) -> int:
        """Tokens seq could add this step with its blocks and every free one."""
        return (len(seq.blocks.table) + self.pool.num_free) * self.pool.block_size - seq.num_computed

    def _grow(self, seq: Sequence, n: int, batch: list[ScheduledSeq], preempt: bool = True) -> bool:
        """Blocks for seq's next n tokens; short of them, preempt sequences this step has not scheduled, the
        latest admitted first (seq itself last). False when seq cannot run this step (it was preempted, or
        preempt is off and the pool is short)."""
        need = self.pool.blocks_for(seq.num_computed + n) - len(seq.blocks.table)
        while need > self.pool.num_free:
            if not preempt:
                return False
            scheduled = {id(s.seq) for s in batch}
            victim = next((s for s in reversed(self.running) if id(s) not in scheduled and s is not seq), seq)
            self._preempt(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.blocks.table += self.pool.allocate(need)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.free_slots.append(seq.slot)
        self.pool.release(seq.blocks.table)
        seq.blocks = SequenceBlocks()
        seq.slot = None
