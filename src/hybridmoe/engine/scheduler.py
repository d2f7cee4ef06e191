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

A model with a recurrent state per sequence (the pool has snapshots, engine/state_snapshots.py) also needs that
state where a reused prefix ends: an arrival's cached prefix is cut back to its last block with a state snapshot,
and its step first copies that snapshot into the sequence's slot (ScheduledSeq.restore); without one the sequence
starts from position 0 with a zero state, as a preempted one does when none of its prefix is left. Each step also
says where its sequences' states are kept as new snapshots (ScheduledSeq.saves, planned by _plan_snapshots).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

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
    restore: int | None = None
    """The state snapshot to copy into seq's slot before the step (its cached prefix ends there), or None."""
    saves: list[tuple[int, int]] = field(default_factory=list)
    """(tokens, snapshot): keep seq's state after that many of this step's tokens in the snapshot (increasing)."""

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
        snapshots = self.pool.snapshots
        if snapshots is not None:
            snapshots.begin_step(self.pool.is_cached)
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
            admitted = self._admit(self.waiting[0], budget)
            if admitted is None:
                break
            self.waiting.popleft()
            batch.append(admitted)
            budget -= admitted.num_tokens
        if snapshots is not None:
            for s in batch:
                self._plan_snapshots(s)
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

    def _admit(self, seq: Sequence, budget: int) -> ScheduledSeq | None:
        """Give the first waiting sequence a slot, its cached prefix and blocks for its first chunk; its step, or
        None (nothing taken) when the pool cannot hold any of the chunk."""
        found, digests = self.pool.match_prefix(self._digests(seq), seq.num_tokens - 1)
        held = self.pool.take(found, digests)
        snapshots = self.pool.snapshots
        if snapshots is not None and held:  # fewer held than found, or a snapshot dropped by take's evictions
            usable = snapshots.usable(digests[:len(held)])
            self.pool.release(held[usable:])
            held = held[:usable]
        cached = len(held) * self.pool.block_size
        n = min(seq.num_uncomputed - cached, budget,
                (len(held) + self.pool.num_free) * self.pool.block_size - cached)
        fresh = self.pool.allocate(self.pool.blocks_for(cached + n) - len(held)) if n > 0 else None
        if fresh is None:
            self.pool.release(held)
            return None
        seq.blocks = SequenceBlocks(held + fresh, digests[:len(held)])
        seq.num_computed = cached
        if seq.num_preemptions == 0:  # a request's first admission: what /metrics counts, what usage reports
            seq.num_cached_tokens = cached
            self.pool.stats.queried_tokens += seq.num_tokens
            self.pool.stats.hit_tokens += cached
        seq.slot = self.free_slots.pop()
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        restore = snapshots.restore(digests[len(held) - 1]) if snapshots is not None and held else None
        return ScheduledSeq(seq, n, restore)

    def _plan_snapshots(self, s: ScheduledSeq) -> None:
        """The snapshots s's step keeps (engine/state_snapshots.py says which boundaries get one): s.saves, each
        in a row reserved under the digest of the block that ends there."""
        snapshots, bs = self.pool.snapshots, self.pool.block_size
        seq, lo, hi = s.seq, s.seq.num_computed, s.seq.num_computed + s.num_tokens
        prompt_end, every = len(seq.prompt_ids) // bs * bs, snapshots.interval * bs
        boundaries = range(lo // bs * bs + bs, hi + 1, bs)
        kept = [b for b in boundaries if b == prompt_end or (every and b % every == 0)]
        latest = boundaries[-1] if boundaries and boundaries[-1] not in kept else None
        for b in sorted(kept + ([latest] if latest is not None else [])):
            digest = self._digests(seq)[b // bs - 1]
            index = snapshots.reserve(digest, kept=b != latest)
            if index is not None:
                s.saves.append((b - lo, index))
            if b == latest and digest in snapshots:  # the sequence's latest boundary replaces its one before
                if seq.latest_snapshot is not None and seq.latest_snapshot != digest:
                    snapshots.drop(seq.latest_snapshot, unkept_only=True)
                seq.latest_snapshot = digest if index is not None else None

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
