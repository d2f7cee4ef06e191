"""Continuous batching with chunked prefill.

Each KV-cache slot holds one sequence's whole context, so a sequence is admitted when a slot is
free and never preempted; it gives its slot back the moment it finishes or is aborted. Every
step runs one token of each decoding sequence first, then spends what is left of the token
budget on prompt chunks (sequences already prefilling first, then new arrivals in order), so a
long prompt is prefilled across several steps while the other streams keep decoding.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from hybridmoe.engine.sequence import Sequence, SequenceStatus


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
    def __init__(self, num_slots: int, max_num_batched_tokens: int):
        self.max_num_batched_tokens = max_num_batched_tokens
        self.free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def admits(self) -> bool:
        """The next schedule() admits a waiting sequence (one waits and a slot is free)."""
        return bool(self.waiting and self.free_slots)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        batch = []
        decoding = [s for s in self.running if s.num_uncomputed == 1]
        prefilling = [s for s in self.running if s.num_uncomputed > 1]
        for seq in decoding:  # always run, even past the budget: decoding streams never stall
            batch.append(ScheduledSeq(seq, 1))
            budget -= 1
        for seq in prefilling:
            if budget <= 0:
                break
            n = min(seq.num_uncomputed, budget)
            batch.append(ScheduledSeq(seq, n))
            budget -= n
        while self.waiting and self.free_slots and budget > 0:
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.pop()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed, budget)
            batch.append(ScheduledSeq(seq, n))
            budget -= n
        return batch

    def finish(self, seq: Sequence) -> None:
        """Take seq out of the schedule and free its slot (finished or aborted)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.free_slots.append(seq.slot)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.slot = None
        seq.status = SequenceStatus.FINISHED
