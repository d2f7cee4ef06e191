"""DeepSeek-V3.2's attention: multi-head latent attention (layers/mla.py) where each query attends only to the
cached positions the lightning indexer (layers/mla_indexer.py) selects for it, causal.

T new tokens, S cached + new tokens of one sequence, N heads, R kv_lora_rank, P qk_rope_head_dim, Hi, Di the
indexer's heads and head size.

Torch ops only: the Triton MLA decode kernel attends densely, so this layer's decode steps take the torch path
(fits_kernels False) and its first projections run unfused (forward_normed), which also gives the indexer the
normalised hidden state and q latent it reads. With index_topk at least the sequence length every query selects
every position it sees and the layer computes exactly dense MLA.
"""

from __future__ import annotations

import torch

from hybridmoe.forward_context import get_context
from hybridmoe.layers.attention import StepIndex
from hybridmoe.layers.kv_quant import read_positions, write_rows
from hybridmoe.layers.mla import SCORE_ELEMENTS, MultiHeadLatentAttention
from hybridmoe.layers.mla_indexer import LightningIndexer
from hybridmoe.layers.norm import RMSNorm


class SparseLatentAttention(MultiHeadLatentAttention):
    def __init__(self, hidden_size: int, num_heads: int, q_lora_rank: int, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, rope: dict,
                 index_n_heads: int, index_head_dim: int, index_topk: int, attention_bias: bool = False):
        super().__init__(hidden_size, num_heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
                         v_head_dim, rope, True, attention_bias)
        self.indexer = LightningIndexer(hidden_size, q_lora_rank, index_n_heads, index_head_dim, qk_rope_head_dim,
                                        index_topk)
        self.fits_kernels = False
        self._index_queries: tuple[torch.Tensor, torch.Tensor] | None = None  # this step's, while forward runs

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], positions [T] -> [T, H]; writes the new tokens' latents and index keys into the caches."""
        q_resid = self.q_a_layernorm(self.q_a_proj(hidden))
        cos, sin = self.rotary(positions, hidden.dtype)
        self.indexer.write_keys(hidden, cos, sin, self._index(hidden.device).token_row)
        self._index_queries = self.indexer.queries(hidden, q_resid, cos, sin)
        try:
            return self._attention(self.q_b_proj(q_resid), self.kv_a_proj_with_mqa(hidden), positions)
        finally:
            self._index_queries = None

    def forward_normed(self, h: torch.Tensor, norm: RMSNorm, positions: torch.Tensor) -> torch.Tensor:
        return self(norm(h), positions)

    def _attend(self, query: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Write kv [T, R + P] into the cache; query [T, N, R + P] -> [T, N, R], each query over its selected
        positions of its sequence's cache."""
        ctx, idx = get_context(), self._index(kv.device)
        write_rows(self.kv_cache, self.kv_scale, idx.token_row, kv)
        iq, weights = self._index_queries
        if ctx.decode is not None:
            return self._attend_fixed_sparse(query, iq, weights, idx)
        N, R = query.shape[1], self.kv_lora_rank
        out = torch.empty(query.shape[0], N, R, dtype=query.dtype, device=query.device)
        for b, (slot, start) in enumerate(zip(ctx.slot_ids, ctx.start_pos)):
            lo, n, first = ctx.cu_seqlens[b], ctx.seq_len(b), ctx.first_block(b)
            rows = idx.block_table[slot]
            cached = read_positions(self.kv_cache, self.kv_scale, rows, start + n, query.dtype, first)
            keys = self.indexer.read_keys(rows, start + n, query.dtype, first)
            k_pos = torch.arange(start + n, device=query.device)
            width = max(N, self.indexer.n_heads)
            step = max(1, SCORE_ELEMENTS // (width * (start + n)))  # queries per slice: bounded score memory
            for q0 in range(0, n, step):
                q1 = min(n, q0 + step)
                q_pos = start + torch.arange(q0, q1, device=query.device)
                visible = k_pos[None, :] <= q_pos[:, None]
                selected = self.indexer.select(iq[lo + q0:lo + q1], weights[lo + q0:lo + q1], keys, visible)
                out[lo + q0:lo + q1] = self._attend_selected(query[lo + q0:lo + q1], cached, selected)
        return out

    def _attend_selected(self, query: torch.Tensor, cached: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
        """query [(B,) m, N, R + P] over cached [(B,) S, R + P], only the selected [(B,) m, S] positions ->
        [(B,) m, N, R]."""
        scores = (query @ cached.transpose(-1, -2).unsqueeze(-3)) * self.scale  # [(B,) m, N, S]
        scores = scores.masked_fill(~selected.unsqueeze(-2), float("-inf"))
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype)
        return probs @ cached[..., :self.kv_lora_rank].unsqueeze(-3)

    def _attend_fixed_sparse(self, query: torch.Tensor, iq: torch.Tensor, weights: torch.Tensor,
                             idx: StepIndex) -> torch.Tensor:
        """A decode step in fixed shapes: B = T rows, each over its slot's first max_seq_len (the padded length)
        positions, those past its length never selected; the new rows already written. -> [B, N, R]."""
        L, table = idx.max_seq_len, idx.block_table[idx.seq_slot]
        cached = read_positions(self.kv_cache, self.kv_scale, table, L, query.dtype)  # [B, L, R + P]
        keys = self.indexer.read_keys(table, L, query.dtype)  # [B, L, Di]
        visible = (torch.arange(L, device=query.device)[None, :] < idx.seq_len[:, None]).unsqueeze(1)  # [B, 1, L]
        selected = self.indexer.select(iq.unsqueeze(1), weights.unsqueeze(1), keys, visible)  # [B, 1, L]
        return self._attend_selected(query.unsqueeze(1), cached, selected).squeeze(1)
