"""The paged KV cache's block pool: which blocks each sequence holds, and which full blocks are cached.

The KV cache is num_blocks blocks of block_size positions (layers/attention.py, layers/mla.py); a sequence holds
a list of blocks, its block table, position p in block p // block_size. Block 0 is never handed out: rows that
only pad a fixed-shape decode step write there.

Prefix caching: a block whose block_size tokens are all computed is registered under a digest of its tokens
and of every token before it (a chain: the digest of block i covers blocks 0..i), so a later sequence whose
tokens start the same way takes those blocks instead of computing them. The digest is SHA-256: a collision
would hand one request another's keys and values, and token ids come from whoever sends a prompt. A block
nobody holds stays registered and goes to the back of the free queue; allocation takes blocks from the front,
so the least recently released cached blocks are evicted first (LRU), and a sequence's later blocks before
its earlier ones (they are released in reverse).

The host tier (host_blocks > 0): a cached block evicted from the device pool is first copied to one of
host_blocks blocks in host memory, kept there under its digest (least recently used dropped first), and a later
prefix that reaches it copies it back into a fresh device block instead of computing it again. The pool only
decides; the copies it asks for wait in `copies` ("out": device block -> host block, "in": host block -> device
block, in order) until the model runner makes them before the next step.

A model with a recurrent state per sequence (Gated DeltaNet) needs that state at the end of a reused prefix too: its
pool has `snapshots` (engine/state_snapshots.py), the states kept at some block boundaries under the digest of the
block that ends there. A prefix is then reused only up to its last block with a snapshot, and a snapshot is dropped
when its digest leaves the cache (evicted from the device with no host tier to take it, or dropped by the host tier).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from hybridmoe.engine.state_snapshots import StateSnapshots

SCRATCH_BLOCK = 0
"""The block padding rows write into; never held by a sequence."""


def block_digest(parent: bytes, tokens: list[int]) -> bytes:
    """The digest of a full block of tokens following the blocks whose digest is parent (b"" for the first)."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class TokenDigests:
    """The chained digests of one sequence's full blocks, each computed once, when first asked for: a sequence's
    tokens only grow, so block i's digest never changes (a prompt that waits for blocks, or comes back after a
    preemption, is not hashed again)."""

    def __init__(self, token_ids: Callable[[int, int], list[int]], block_size: int):
        self._token_ids, self._block_size, self._digests = token_ids, block_size, []

    @classmethod
    def of(cls, tokens: list[int], block_size: int) -> TokenDigests:
        return cls(lambda start, stop: tokens[start:stop], block_size)

    def __getitem__(self, i: int) -> bytes:
        """Block i's digest (its tokens must be there)."""
        bs = self._block_size
        while len(self._digests) <= i:
            k = len(self._digests)
            self._digests.append(block_digest(self._digests[-1] if k else b"", self._token_ids(k * bs, (k + 1) * bs)))
        return self._digests[i]


@dataclass
class BlockStats:
    """Prefix-cache lookups since the engine started: prompt tokens asked for and found cached."""

    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass(frozen=True)
class BlockCopy:
    direction: str
    """"out": device -> host; "in": host -> device."""
    device_block: int
    host_block: int


@dataclass
class SequenceBlocks:
    """One sequence's blocks: its block table and the digests of its full blocks registered so far."""

    table: list[int] = field(default_factory=list)
    digests: list[bytes] = field(default_factory=list)
    """digests[i]: the chained digest of block i (for every i < len(digests))."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True, host_blocks: int = 0,
                 snapshots: StateSnapshots | None = None):
        """snapshots: the recurrent states kept at block boundaries, for a model that keeps one per sequence (None:
        a model of attention layers only, or prefix caching off)."""
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (one is scratch), got {num_blocks}")
        self.num_blocks, self.block_size, self.prefix_caching = num_blocks, block_size, prefix_caching
        self.refs = [0] * num_blocks
        self.digest_of: dict[int, bytes] = {}  # block -> its registered digest
        self.cached: dict[bytes, int] = {}  # digest -> block
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.stats = BlockStats()
        self.host_blocks = host_blocks if prefix_caching else 0
        self.on_host: OrderedDict[bytes, int] = OrderedDict()  # digest -> host block, least recently used first
        self.host_free = list(range(self.host_blocks - 1, -1, -1))
        self.copies: list[BlockCopy] = []
        """Copies between the device and the host tier the next step must make first, in order."""
        self.snapshots = snapshots if prefix_caching else None

    @property
    def num_free(self) -> int:
        """Blocks that allocation can take now (unheld, cached ones included)."""
        return len(self.free)

    @property
    def usable_blocks(self) -> int:
        """Every block but the scratch block."""
        return self.num_blocks - 1

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, tokens: TokenDigests, limit: int) -> tuple[list[int | None], list[bytes]]:
        """The longest cached prefix of a sequence's full blocks (tokens: their digests), at most limit tokens (so
        a sequence keeps at least one token to compute), cut back to its last block with a state snapshot when the
        pool keeps snapshots: per block its device block, or None where only the host tier holds it; and their
        digests. Takes no reference (take does)."""
        found, digests = [], []
        if self.prefix_caching:
            for i in range(limit // self.block_size):
                digest = tokens[i]
                block = self.cached.get(digest)
                if block is None and digest not in self.on_host:
                    break
                found.append(block)
                digests.append(digest)
        if self.snapshots is not None:
            usable = self.snapshots.usable(digests)
            found, digests = found[:usable], digests[:usable]
        return found, digests

    def take(self, found: list[int | None], digests: list[bytes]) -> list[int]:
        """Hold match_prefix's blocks for a sequence, copying those only the host tier holds back into fresh
        device blocks; the held blocks, fewer than found where the pool has no block for a copy."""
        # The sequence's host blocks leave the LRU until they are copied in: the device blocks their copies evict
        # go to the host tier, and a full tier would otherwise drop the next of them to make room.
        pinned = {d: self.on_host.pop(d) for d in digests if d in self.on_host}
        held = []
        try:
            for block, digest in zip(found, digests):
                if block is not None and self.cached.get(digest) == block:
                    if self.refs[block] == 0:
                        del self.free[block]
                    self.refs[block] += 1
                else:  # on the host (or evicted from the device since the match)
                    host = pinned.get(digest)
                    if host is None:
                        host = pinned[digest] = self.on_host.pop(digest, None)
                    fresh = self.allocate(1) if host is not None else None
                    if fresh is None:
                        break
                    block = fresh[0]
                    self.copies.append(BlockCopy("in", block, host))
                    self.cached[digest], self.digest_of[block] = block, digest
                held.append(block)
        finally:
            for digest, host in pinned.items():
                if host is not None:
                    self.on_host[digest] = host
        return held

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks held once each, evicting the least recently released cached ones; None (nothing
        taken) when fewer than n are free."""
        if n > len(self.free):
            return None
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            digest = self.digest_of.pop(b, None)
            if digest is not None:
                del self.cached[digest]
                self._keep_on_host(b, digest)
                self._forget_snapshot(digest)
            self.refs[b] = 1
            out.append(b)
        return out

    def _keep_on_host(self, block: int, digest: bytes) -> None:
        """An evicted cached block into the host tier (copied unless the tier holds its digest already)."""
        if digest in self.on_host:
            self.on_host.move_to_end(digest)
            return
        if not self.host_free and self.on_host:
            gone, dropped = self.on_host.popitem(last=False)
            self.host_free.append(dropped)
            self._forget_snapshot(gone)
        if not self.host_free:  # no tier, or its one block is being copied in
            return
        host = self.host_free.pop()
        self.on_host[digest] = host
        self.copies.append(BlockCopy("out", block, host))

    def is_cached(self, digest: bytes) -> bool:
        """The device or the host tier caches the block of digest."""
        return digest in self.cached or digest in self.on_host

    def _forget_snapshot(self, digest: bytes) -> None:
        """Drop digest's state snapshot once neither the device nor the host tier caches the block."""
        if self.snapshots is not None and not self.is_cached(digest):
            self.snapshots.drop(digest)

    def release(self, blocks: list[int]) -> None:
        """Drop one hold of each block; unheld ones become free, the last ones first in line for eviction."""
        for b in reversed(blocks):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free[b] = None
            elif self.refs[b] < 0:
                raise RuntimeError(f"KV block {b} released more often than it was held")

    def register(self, seq: SequenceBlocks, tokens: TokenDigests, num_computed: int) -> None:
        """Register the sequence's blocks that num_computed made full (tokens: their digests). A block whose
        digest another block already has stays unregistered (the other is found instead)."""
        if not self.prefix_caching:
            return
        while len(seq.digests) < min(num_computed // self.block_size, len(seq.table)):
            i = len(seq.digests)
            digest = tokens[i]
            seq.digests.append(digest)
            block = seq.table[i]
            if digest not in self.cached and block not in self.digest_of:
                self.cached[digest] = block
                self.digest_of[block] = digest
