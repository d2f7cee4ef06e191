"""Snapshots of the recurrent state at block boundaries: prefix caching for models that keep a state per sequence.

A model with Gated DeltaNet layers (models/base.py state_bytes_per_seq) holds a running sequence's history in two
places: its attention layers' keys and values in the paged KV cache, and every DeltaNet layer's convolution and
recurrent state in the sequence's slot (layers/linear_attention.py). A cached KV block (engine/kv_blocks.py) gives
back the first; a snapshot gives back the second: every DeltaNet layer's state of one sequence after the tokens up to
a block boundary, kept in one of num_snapshots rows beside the slots, under the digest of the block that ends there
(the digest covers every token before it too). A later sequence whose cached prefix ends at that block copies the
snapshot into its slot and computes only the tokens after it; a cached prefix whose last block has no snapshot is
cut back to the last of its blocks that has one (BlockPool.match_prefix).

A snapshot costs a whole sequence's state (tens of MB for Qwen3-Next-80B), so only boundaries a later request is
likely to reach get one; the scheduler asks for them with the step that computes the boundary
(Scheduler._plan_snapshots), and the step keeps the state there (the rule runs in segments split at it):
  - the last full block of each prompt: what the same conversation re-sent with a new turn, or the same prompt
    again, reaches;
  - the latest full block a sequence has computed (its prompt's chunks, then its reply), replaced as it moves on
    (the one before is dropped): where a preempted sequence resumes, and what a conversation re-sent with its reply
    reaches;
  - with interval, every interval-th block (a prompt shared up to some point, like a long system prompt).
A snapshot lives with its block's cache entry: the pool drops it when the digest leaves the prefix cache (both the
device's blocks and the host tier). The rows are few (kv_plan.py sizes them); when all are taken, a new snapshot
replaces the least recently used one (saved or restored), whose blocks then serve no prefix that ends there.

Within a step, a row that the step restores from or saves into is not handed out again (a dropped one comes back
after the step), so the step's copies never race.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass
class _Snapshot:
    index: int
    kept: bool
    """A prompt's end or an interval's block: not dropped when the sequence that saved it moves on."""


@dataclass
class SnapshotStats:
    saved: int = 0
    restored: int = 0
    evicted: int = 0
    """Dropped to make room for a newer snapshot while their blocks were still cached."""


class StateSnapshots:
    def __init__(self, num_snapshots: int, interval: int = 0):
        """num_snapshots rows (their index i is the model's snapshot i, models/base.py allocate_state); interval:
        also keep a snapshot every interval-th block (0: none)."""
        if num_snapshots < 0 or interval < 0:
            raise ValueError(f"num_snapshots and interval must be >= 0, got {num_snapshots} and {interval}")
        self.num_snapshots, self.interval = num_snapshots, interval
        self.entries: OrderedDict[bytes, _Snapshot] = OrderedDict()  # digest -> snapshot, least recently used first
        self.free = list(range(num_snapshots - 1, -1, -1))
        self._busy: set[int] = set()  # rows this step restores from or saves into
        self._freed_in_step: list[int] = []  # busy rows dropped during the step: free once it ran
        self.stats = SnapshotStats()

    def __contains__(self, digest: bytes) -> bool:
        return digest in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def begin_step(self, is_cached: Callable[[bytes], bool]) -> None:
        """A new step is being scheduled: the last one's rows are no longer in use, and a snapshot whose block the
        prefix cache does not have (is_cached: a step that failed before its blocks were registered) is dropped, so
        that no row holds a state its step did not finish."""
        self._busy.clear()
        self.free += self._freed_in_step
        self._freed_in_step.clear()
        for digest in [d for d in self.entries if not is_cached(d)]:
            self.drop(digest)

    @property
    def free_rows(self) -> list[int]:
        """Rows holding no snapshot (those dropped during the step included)."""
        return self.free + self._freed_in_step

    def rows(self) -> dict[bytes, int]:
        """Each snapshot's row, by the digest of its block."""
        return {digest: entry.index for digest, entry in self.entries.items()}

    def usable(self, digests: Sequence[bytes]) -> int:
        """How many of a prefix's leading blocks (digests) to reuse: up to the last one with a snapshot."""
        for i in range(len(digests) - 1, -1, -1):
            if digests[i] in self.entries:
                return i + 1
        return 0

    def restore(self, digest: bytes) -> int:
        """The snapshot of digest (it must have one), marked used: this step copies it into a slot."""
        entry = self.entries[digest]
        self.entries.move_to_end(digest)
        self._busy.add(entry.index)
        self.stats.restored += 1
        return entry.index

    def reserve(self, digest: bytes, kept: bool) -> int | None:
        """A row for this step to keep the state at digest's block in; None when there is nothing to save (digest
        has a snapshot already, which becomes the most recently used) or no row this step may take."""
        entry = self.entries.get(digest)
        if entry is not None:
            entry.kept |= kept
            self.entries.move_to_end(digest)
            return None
        if self.free:
            index = self.free.pop()
        else:
            victim = next((d for d, e in self.entries.items() if e.index not in self._busy), None)
            if victim is None:
                return None
            index = self.entries.pop(victim).index
            self.stats.evicted += 1
        self.entries[digest] = _Snapshot(index, kept)
        self._busy.add(index)
        self.stats.saved += 1
        return index

    def drop(self, digest: bytes, unkept_only: bool = False) -> None:
        """Forget digest's snapshot, if it has one (with unkept_only: only a latest-boundary one, whose kept is
        False), and free its row."""
        entry = self.entries.get(digest)
        if entry is None or (unkept_only and entry.kept):
            return
        del self.entries[digest]
        (self._freed_in_step if entry.index in self._busy else self.free).append(entry.index)
