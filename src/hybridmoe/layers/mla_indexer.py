"""DeepSeek-V3.2's lightning indexer (DeepSeek Sparse Attention): which cached keys each query attends to.

T new tokens, S cached + new tokens, Hi index heads, Di index_head_dim, P qk_rope_head_dim, Q q_lora_rank.

Per token the indexer caches one index key k = rotary(LayerNorm(wk x)) [Di] beside the MLA latent, in a paged
cache of its own ([NB, BS, Di], the same blocks and block table as the latent's). A query at position t scores
every cached position s <= t as

    I(t, s) = sum_h w(t, h) * relu(q(t, h) . k(s) / sqrt(Di)),   w = weights_proj(x) / sqrt(Hi)

with q = rotary(wq_b q_resid) [Hi, Di] from the attention's normalised q latent, and keeps the index_topk best
(every position when it sees no more than index_topk). The rotary turns the first P dimensions of q and k as
halves (not DeepSeek's interleaved pairs), with the attention's cos/sin. The scoring follows transformers'
DeepseekV32Indexer in float32: its Hadamard rotation of q and k keeps dot products, so it is left out.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridmoe.layers.kv_quant import FP8, read_positions, write_rows
from hybridmoe.layers.rotary import apply_rotary


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """q [..., m, Hi, Di], weights [..., m, Hi] float32, keys [..., S, Di] -> I [..., m, S] float32."""
    scores = torch.relu((q.float() @ keys.float().transpose(-1, -2).unsqueeze(-3)) * scale)  # [..., m, Hi, S]
    return (weights.unsqueeze(-2) @ scores).squeeze(-2)


def select_topk(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """scores [..., m, S], visible [..., m, S] bool -> the selected keys [..., m, S] bool: each row's topk
    highest-scoring visible keys (all its visible keys when it has no more than topk)."""
    k = min(topk, scores.shape[-1])
    best = scores.masked_fill(~visible, float("-inf")).topk(k, dim=-1).indices
    return torch.zeros_like(visible).scatter(-1, best, True) & visible


class LightningIndexer(nn.Module):
    """The indexer's weights (named as in DeepSeek-V3.2's checkpoints: self_attn.indexer.*) and its key cache."""

    def __init__(self, hidden_size: int, q_lora_rank: int, n_heads: int, head_dim: int, rope_dim: int, topk: int):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim, self.topk = n_heads, head_dim, rope_dim, topk
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden_size, n_heads, bias=False)
        self.scale = head_dim ** -0.5
        self.kv_cache: torch.Tensor | None = None  # [NB, BS, Di] index keys
        self.kv_scale: torch.Tensor | None = None  # [NB, BS, 1] float32, with a float8 cache

    def kv_bytes_per_token(self, quantized: bool = False) -> int:
        """One token's index key: in the compute dtype, or float8 codes and a float32 scale."""
        return self.head_dim + 4 if quantized else self.head_dim * self.wk.weight.element_size()

    def allocate_kv_cache(self, num_blocks: int, block_size: int, slot_table: torch.Tensor | None = None,
                          quantized: bool = False) -> None:
        """An index-key cache of num_blocks blocks of block_size positions (slot_table: the attention's)."""
        w = self.wk.weight
        self.kv_cache = torch.zeros(num_blocks, block_size, self.head_dim, dtype=FP8 if quantized else w.dtype,
                                    device=w.device)
        self.kv_scale = torch.zeros(num_blocks, block_size, 1, device=w.device) if quantized else None

    def write_keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor) -> None:
        """The index keys of x [T, H] (normalised hidden states) into the cache's flat rows [T]."""
        if self.kv_cache is None:
            raise RuntimeError("the indexer needs its key cache: call allocate_kv_cache first")
        k = apply_rotary(self.k_norm(self.wk(x)).unsqueeze(1), cos[:, :self.rope_dim], sin[:, :self.rope_dim])
        write_rows(self.kv_cache, self.kv_scale, rows, k.squeeze(1))

    def read_keys(self, table_rows: torch.Tensor, length: int, dtype: torch.dtype,
                  first_block: int | None = None) -> torch.Tensor:
        """The first length cached index keys of a slot ([length, Di]) or of each slot ([B, length, Di])."""
        return read_positions(self.kv_cache, self.kv_scale, table_rows, length, dtype, first_block)

    def queries(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H], q_resid [T, Q] -> index queries [T, Hi, Di] and head weights [T, Hi] float32."""
        q = self.wq_b(q_resid).view(x.shape[0], self.n_heads, self.head_dim)
        q = apply_rotary(q, cos[:, :self.rope_dim], sin[:, :self.rope_dim])
        weights = nn.functional.linear(x.float(), self.weights_proj.weight.float()) * self.n_heads ** -0.5
        return q, weights

    def select(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
               visible: torch.Tensor) -> torch.Tensor:
        """q [..., m, Hi, Di], weights [..., m, Hi], keys [..., S, Di], visible [..., m, S] -> selected keys
        [..., m, S] bool."""
        return select_topk(index_scores(q, weights, keys, self.scale), visible, self.topk)
