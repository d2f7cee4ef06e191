"""Multi-head latent attention (DeepSeek-V2 §2.1), with the compressed latent as the KV cache.

T new tokens, S cached + new tokens of one sequence, N heads, R kv_lora_rank, P
qk_rope_head_dim, D qk_nope_head_dim, V v_head_dim.

Each token caches only [R + P] numbers: the normalised latent c (from which kv_b_proj
would expand every head's nope key and value) and the one rotary key k_pe shared by all
heads. Attention never expands the cache: kv_b_proj's key half is absorbed into the query
(q_nope W_UK^T, [N, R]) and its value half applied after the softmax, so per head

    score(t, s) = (q_nope W_UK^T) . c_s + q_pe . k_pe_s,   out = (sum_s p(t, s) c_s) W_UV^T

which is one multi-query attention with key [c, k_pe] (R + P wide) and value c (R wide),
over a paged cache of [NB blocks, BS positions, R + P] (layers/attention.py's block tables).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridmoe.forward_context import get_context
from hybridmoe.layers.attention import StepIndex, step_index
from hybridmoe.layers.kv_quant import FP8, kernels_read_fp8, read_positions, write_rows
from hybridmoe.layers.linear import decode_gemv, norm_linear
from hybridmoe.layers.norm import RMSNorm
from hybridmoe.layers.rotary import RotaryEmbedding, apply_rotary
from hybridmoe.layers.yarn import softmax_scale
from hybridmoe.platform import HAVE_TRITON

SCORE_ELEMENTS = 1 << 26
"""Most attention scores one slice of a prefill chunk's queries computes at once (x 4 bytes in the softmax): a
chunk over a long cached prefix runs in slices of queries, so its memory stays bounded at any length."""

def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x0, x1), (x2, x3), ... as DeepSeek's checkpoints lay them out.

    x [T, heads, P]; cos, sin [T, P] as RotaryEmbedding gives them (both halves equal).
    The result comes back de-interleaved (evens then odds); q and k get the same permutation,
    so their dot products are unchanged.
    """
    half = x.shape[-1] // 2
    cos, sin = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, rope: dict,
                 rope_interleave: bool = True, attention_bias: bool = False):
        super().__init__()
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, num_heads * qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=attention_bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank)  # eps 1e-6 whatever rms_norm_eps, as in DeepSeek's code
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=attention_bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=attention_bias)
        self.rotary = RotaryEmbedding(qk_rope_head_dim, rope)
        self.rotate = apply_rotary_interleaved if rope_interleave else apply_rotary
        self.scale = softmax_scale(rope, qk_head_dim)
        self.kv_cache: torch.Tensor | None = None  # [NB, BS, R + P]
        self.kv_scale: torch.Tensor | None = None  # [NB, BS, 1] float32, with a float8 cache (layers/kv_quant.py)
        self.slot_table: torch.Tensor | None = None  # contiguous slots, for contexts without a block table
        # on CUDA, a fixed-shape decode step: rotary, the latent's norm, the cache write and the attention in
        # one kernel launch per chunk of positions (mla_decode_triton.py); one token: the projections
        # as decode GEMVs (forward_normed, o_proj); MoECausalLM.fuse_decode_kernels
        self.fused_layer = True
        self.fits_kernels = True  # False: a subclass whose attention the Triton decode kernel does not compute

    def kv_bytes_per_token(self, quantized: bool = False) -> int:
        """One token's latent: in the compute dtype, or float8 codes and a float32 scale."""
        width = self.kv_lora_rank + self.qk_rope_head_dim
        return width + 4 if quantized else width * self.kv_a_proj_with_mqa.weight.element_size()

    def allocate_kv_cache(self, num_blocks: int, block_size: int, slot_table: torch.Tensor | None = None,
                          quantized: bool = False) -> None:
        """A latent cache of num_blocks blocks of block_size positions (slot_table: see Attention's; quantized:
        float8 with a scale per token)."""
        w = self.kv_a_proj_with_mqa.weight
        self.kv_cache = torch.zeros(num_blocks, block_size, self.kv_lora_rank + self.qk_rope_head_dim,
                                    dtype=FP8 if quantized else w.dtype, device=w.device)
        self.kv_scale = torch.zeros(num_blocks, block_size, 1, device=w.device) if quantized else None
        self.slot_table = slot_table

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], positions [T] -> [T, H]; writes the new tokens' latents into the cache."""
        if hasattr(self, "q_proj"):
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        return self._attention(q, self.kv_a_proj_with_mqa(hidden), positions)

    def forward_normed(self, h: torch.Tensor, norm: RMSNorm, positions: torch.Tensor) -> torch.Tensor:
        """forward(norm(h), positions) with fused_layer's decode GEMVs where they run (layers/linear.py):
        the norm folded into q_proj (or q_a_proj), q_a_layernorm into q_b_proj, and kv_a_proj_with_mqa."""
        first = self.q_proj if hasattr(self, "q_proj") else self.q_a_proj
        if not decode_gemv(h, self.fused_layer, first):
            return self(norm(h), positions)
        q, x, _ = norm_linear(h, first, norm)
        if not hasattr(self, "q_proj"):
            q = norm_linear(q, self.q_b_proj, self.q_a_layernorm)[0]
        return self._attention(q, norm_linear(x, self.kv_a_proj_with_mqa)[0], positions)

    def _attention(self, q: torch.Tensor, kv_a: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """From the projections q [T, N (D + P)] and kv_a [T, R + P] of the step's tokens to the output [T, H]."""
        T, N, R, D = q.shape[0], self.num_heads, self.kv_lora_rank, self.qk_nope_head_dim
        q_nope, q_pe = q.view(T, N, -1).split([D, self.qk_rope_head_dim], dim=-1)
        latent, k_pe = kv_a.split([R, self.qk_rope_head_dim], dim=-1)
        w_kv = self.kv_b_proj.weight.view(N, D + self.v_head_dim, R)
        w_uk, w_uv = w_kv[:, :D], w_kv[:, D:]  # [N, D, R], [N, V, R]
        q_abs = torch.einsum("tnd,ndr->tnr", q_nope, w_uk)  # [T, N, R]
        decode = get_context().decode
        if (self.fused_layer and self.fits_kernels and HAVE_TRITON and q.is_cuda and self.kv_cache is not None
                and decode is not None and (self.kv_scale is None or kernels_read_fp8(q.device))):
            from hybridmoe.layers.mla_decode_triton import triton_mla_decode

            norm, idx = self.kv_a_layernorm, self._index(q.device)
            out = triton_mla_decode(q_abs, q_pe, latent, k_pe, norm.weight, norm.eps, positions,
                                    self.rotary.inv_freq(q.device), self.rotary.attention_scaling,
                                    self.rotate is apply_rotary_interleaved, self.kv_cache, idx.block_table,
                                    decode.slots, decode.lens, self.scale, decode.pad_len, self.kv_scale)
        else:
            cos, sin = self.rotary(positions, q.dtype)
            q_pe = self.rotate(q_pe, cos, sin)
            k_pe = self.rotate(k_pe.unsqueeze(1), cos, sin).squeeze(1)
            query = torch.cat((q_abs, q_pe), dim=-1)  # [T, N, R + P]
            out = self._attend(query, torch.cat((self.kv_a_layernorm(latent), k_pe), dim=-1), positions)
        out = torch.einsum("tnr,nvr->tnv", out, w_uv).reshape(T, N * self.v_head_dim)  # [T, N V]
        if decode_gemv(out, self.fused_layer, self.o_proj):
            return norm_linear(out, self.o_proj)[0]
        return self.o_proj(out)

    def _index(self, device: torch.device) -> StepIndex:
        if self.kv_cache is None:
            raise RuntimeError("MLA needs its latent KV cache: call allocate_kv_cache first")
        return step_index(get_context(), device, self.slot_table, self.kv_cache.shape[1])

    def _attend(self, query: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Write kv [T, R + P] into the cache; query [T, N, R + P] -> [T, N, R] over each sequence's cache.

        All N heads share one key, so a sequence's T_b queries of N heads are T_b * N rows of
        one matmul against its cached positions (gathered from its blocks once, not per head).
        """
        ctx, idx = get_context(), self._index(kv.device)
        write_rows(self.kv_cache, self.kv_scale, idx.token_row, kv)
        if ctx.decode is not None:
            return self._attend_fixed(query, idx)
        N, R = query.shape[1], self.kv_lora_rank
        out = torch.empty(query.shape[0], N, R, dtype=query.dtype, device=query.device)
        for b, (slot, start) in enumerate(zip(ctx.slot_ids, ctx.start_pos)):
            lo, n = ctx.cu_seqlens[b], ctx.seq_len(b)
            cached = read_positions(self.kv_cache, self.kv_scale, idx.block_table[slot], start + n, query.dtype,
                                    ctx.first_block(b))
            step = max(1, SCORE_ELEMENTS // (N * (start + n)))  # queries per slice: bounded score memory
            for q0 in range(0, n, step):
                q1 = min(n, q0 + step)
                out[lo + q0:lo + q1] = self._attend_rows(query[lo + q0:lo + q1], cached, start + q0)
        return out

    def _attend_rows(self, query: torch.Tensor, cached: torch.Tensor, first: int) -> torch.Tensor:
        """Consecutive queries [m, N, R + P] at positions first.. over cached [S, R + P], causal -> [m, N, R]."""
        m, N, R = query.shape[0], query.shape[1], self.kv_lora_rank
        scores = (query.reshape(m * N, -1) @ cached.T).view(m, N, -1) * self.scale
        if first + m < cached.shape[0] or m > 1:  # query i sits at position first + i and sees 0 .. first + i
            k_pos = torch.arange(cached.shape[0], device=query.device)
            hidden_keys = k_pos[None, :] > first + torch.arange(m, device=query.device)[:, None]
            scores = scores.masked_fill(hidden_keys[:, None, :], float("-inf"))
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype)
        return (probs.view(m * N, -1) @ cached[:, :R]).view(m, N, R)

    def _attend_fixed(self, query: torch.Tensor, idx: StepIndex) -> torch.Tensor:
        """A decode step in fixed shapes: B = T rows, each over its slot's first max_seq_len (the padded length)
        positions, those past its length masked; the new rows already written. query [B, N, R + P] -> [B, N, R]."""
        R, L = self.kv_lora_rank, idx.max_seq_len
        cached = read_positions(self.kv_cache, self.kv_scale, idx.block_table[idx.seq_slot], L, query.dtype)
        scores = (query @ cached.transpose(1, 2)) * self.scale  # [B, N, L]
        hidden_keys = torch.arange(L, device=query.device)[None, :] >= idx.seq_len[:, None]  # [B, L]
        scores = scores.masked_fill(hidden_keys[:, None, :], float("-inf"))
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype)
        return probs @ cached[..., :R]
