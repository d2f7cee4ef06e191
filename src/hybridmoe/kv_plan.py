"""The paged KV cache's size and the longest sequence it serves, from the engine's options and the model's bytes
per cached token.

kv_cache_budget sets the cache's memory; without it the cache holds max_num_seqs x 4096 tokens (what one
contiguous slot per sequence of the default length held), or one max_model_len sequence if that is more.
kv_cpu_budget sets the host tier's (none on the CPU device, whose cache is in host memory already; as large as
the device's cache on a GPU, at most half the host's available memory, unless given). A
sequence may be as long as the model allows (max_position_embeddings, YaRN's stretch included) when the cache
holds that many tokens, else as long as the cache holds: concurrent sequences share the blocks, and one that
finds none free is preempted and resumed later (engine/scheduler.py).

A model whose layers keep a recurrent state per sequence instead of a KV cache (Gated DeltaNet) holds
max_num_seqs of those states beside the blocks (on a GPU one more, for the padding rows of fixed-shape decode
steps): they count in the cache's memory, and a kv_cache_budget pays for them
first. With prefix caching it also keeps snapshots of such states at block boundaries (engine/state_snapshots.py):
SNAPSHOTS_PER_SEQ per sequence it runs at once (a prompt's end and a sequence's latest block boundary), fewer when a
kv_cache_budget's share for them (SNAPSHOT_SHARE of what the live states and one block leave) holds fewer. They
count in the cache's memory too.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridmoe.config import DEFAULT_MAX_MODEL_LEN, EngineConfig, check_max_model_len, format_bytes, position_limit
from hybridmoe.errors import HybridMoEError

SNAPSHOTS_PER_SEQ = 2
"""State snapshots kept per sequence the engine runs at once: each conversation's prompt end and latest boundary."""

SNAPSHOT_SHARE = 0.5
"""The most of a kv_cache_budget (past the live states and one block) that state snapshots take; blocks get the
rest."""


@dataclass(frozen=True)
class KVPlan:
    num_blocks: int
    """Blocks allocated, the scratch block (engine/kv_blocks.py) included."""
    block_size: int
    max_model_len: int
    bytes_per_token: int
    """KV-cache bytes one token takes over all layers."""
    model_limit: int | None
    """The positions the model knows (None: it states none)."""
    host_blocks: int = 0
    """Blocks of the host tier (engine/kv_blocks.py), 0: none."""
    state_bytes: int = 0
    """The recurrent states of max_num_seqs sequences (models/base.py state_bytes_per_seq), beside the blocks, and
    on a GPU one more: the spare slot of fixed-shape decode steps' padding rows."""
    snapshots: int = 0
    """Recurrent-state snapshots kept for prefix caching (engine/state_snapshots.py)."""
    snapshot_bytes: int = 0
    """Their memory, beside the blocks and the live states."""

    @property
    def tokens(self) -> int:
        """Positions the sequences can hold together."""
        return (self.num_blocks - 1) * self.block_size

    @property
    def bytes(self) -> int:
        return self.num_blocks * self.block_size * self.bytes_per_token + self.state_bytes + self.snapshot_bytes

    def line(self) -> str:
        """The load's line about the cache: its size, the tokens per GiB (the trade against cached experts) and
        the context it chose."""
        per_gib = (1 << 30) // max(self.bytes_per_token, 1)
        why = "" if self.model_limit is None else (
            " (the model's limit)" if self.max_model_len == self.model_limit
            else f" (the model knows {self.model_limit}; --kv-cache-budget or --max-model-len for more)")
        host_tokens = self.host_blocks * self.block_size
        host = (f"; host tier {host_tokens} tokens, {format_bytes(host_tokens * self.bytes_per_token)}"
                if self.host_blocks else "")
        state = f", recurrent states {format_bytes(self.state_bytes)}" if self.state_bytes else ""
        if self.state_bytes and self.snapshot_bytes:
            state += f" and {self.snapshots} prefix snapshots of them {format_bytes(self.snapshot_bytes)}"
        return (f"{self.tokens} tokens in blocks of {self.block_size}, {format_bytes(self.bytes)}{state} "
                f"({per_gib} tokens per GiB); max_model_len {self.max_model_len}{why}{host}")


def plan_kv_cache(model_config, engine_config: EngineConfig, bytes_per_token: int,
                  host_available: int = 0, state_bytes_per_seq: int = 0) -> KVPlan:
    """The cache and max_model_len for a model whose tokens take bytes_per_token of KV cache each and whose
    sequences hold state_bytes_per_seq of recurrent state each. host_available: the host's available memory (0:
    unknown), which caps the default host tier at half of it."""
    check_max_model_len(model_config, engine_config)
    bs, given, limit = engine_config.kv_block_size, engine_config.max_model_len, position_limit(model_config)
    # on a GPU, fixed-shape decode steps give their padding rows a spare slot's state (engine/model_runner.py)
    states = (engine_config.max_num_seqs + int(str(engine_config.device).startswith("cuda"))) * state_bytes_per_seq
    block_bytes = max(bytes_per_token, 1) * bs  # a model of stateful layers only caches no keys at all
    snapshots = _snapshots(engine_config, state_bytes_per_seq, engine_config.kv_cache_budget - states - block_bytes
                           if engine_config.kv_cache_budget is not None else None)
    if engine_config.kv_cache_budget is not None:
        blocks = (engine_config.kv_cache_budget - states - snapshots * state_bytes_per_seq) // block_bytes
        if blocks < 1:
            held = f" beside {format_bytes(states)} of recurrent states" if states else ""
            raise HybridMoEError(
                f"kv_cache_budget {format_bytes(engine_config.kv_cache_budget)} holds no block of {bs} tokens "
                f"({format_bytes(bytes_per_token * bs)} each){held}; raise --kv-cache-budget")
    else:
        blocks = -(-max(engine_config.max_num_seqs * DEFAULT_MAX_MODEL_LEN, given or 0) // bs)
    tokens = blocks * bs
    if given is not None and given > tokens:
        raise HybridMoEError(
            f"max_model_len {given} needs {format_bytes(given * bytes_per_token)} of KV cache, and "
            f"kv_cache_budget {format_bytes(engine_config.kv_cache_budget)} holds {tokens} tokens; raise "
            "--kv-cache-budget or lower --max-model-len")
    max_len = given or min(limit or tokens, tokens)
    host = engine_config.kv_cpu_budget
    if host is None:  # the default: as large as the device's cache on a GPU, at most half the available memory
        cap = host_available // 2 // block_bytes if host_available else blocks
        host_blocks = min(blocks, cap) if engine_config.device == "cuda" else 0
    else:
        host_blocks = host // block_bytes
    return KVPlan(blocks + 1, bs, max_len, bytes_per_token, limit, host_blocks if engine_config.prefix_caching else 0,
                  states, snapshots, snapshots * state_bytes_per_seq)


def _snapshots(engine_config: EngineConfig, state_bytes_per_seq: int, spare: int | None) -> int:
    """How many recurrent-state snapshots prefix caching keeps (0 without a recurrent state or prefix caching).
    spare: a kv_cache_budget's bytes past the live states and one block (None: no budget)."""
    if not state_bytes_per_seq or not engine_config.prefix_caching:
        return 0
    wanted = SNAPSHOTS_PER_SEQ * engine_config.max_num_seqs
    if spare is None:
        return wanted
    return max(0, min(wanted, int(spare * SNAPSHOT_SHARE) // state_bytes_per_seq))
