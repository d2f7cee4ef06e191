"""Attention over a paged KV cache, and the GQA attention layer of Qwen/Mixtral.

The step's sequences come flattened (see forward_context.py). T new tokens, B sequences,
Hq query heads, Hkv key/value heads, D head dim (Dk for keys, Dv for values), NB cache blocks
of BS positions, S slots (rows of the block table), M blocks per slot at most.
Cache layout: k [NB, BS, Hkv, Dk], v [NB, BS, Hkv, Dv]; slot s's position p sits in block
block_table[s, p // BS] at row p % BS.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hybridmoe.forward_context import Context, get_context
from hybridmoe.layers.kv_quant import FP8, kernels_read_fp8, read_positions, write_rows
from hybridmoe.layers.linear import MergedLinear, decode_gemv, norm_linear
from hybridmoe.layers.norm import RMSNorm
from hybridmoe.layers.rotary import RotaryEmbedding, apply_rotary
from hybridmoe.layers.sink_attention import attend_with_sinks
from hybridmoe.platform import HAVE_TRITON


def contiguous_slot_table(num_slots: int, max_len: int, block_size: int, device: torch.device) -> torch.Tensor:
    """[num_slots, M] int32: slot s holds blocks s * M .. s * M + M - 1 (M blocks cover max_len positions)."""
    per_slot = -(-max_len // block_size)
    return torch.arange(num_slots * per_slot, dtype=torch.int32, device=device).view(num_slots, per_slot)


class KVCache:
    """Keys and values of one attention layer in num_blocks blocks of block_size positions, in the compute dtype
    or (quantized) in float8 with a scale per token and head (layers/kv_quant.py).

    slot_table: the block table of contiguous slots used when a step's context carries none."""

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, k_dim: int, v_dim: int,
                 dtype: torch.dtype, device: torch.device, slot_table: torch.Tensor | None = None,
                 quantized: bool = False):
        store = FP8 if quantized else dtype
        self.k = torch.zeros(num_blocks, block_size, num_kv_heads, k_dim, dtype=store, device=device)
        self.v = torch.zeros(num_blocks, block_size, num_kv_heads, v_dim, dtype=store, device=device)
        scales = [torch.zeros(num_blocks, block_size, num_kv_heads, 1, device=device) for _ in range(2)]
        self.k_scale, self.v_scale = scales if quantized else (None, None)
        self.dtype, self.slot_table = dtype, slot_table

    @property
    def block_size(self) -> int:
        return self.k.shape[1]

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    def tensors(self) -> list[torch.Tensor]:
        """What holds the cache's state (the host tier copies these)."""
        return [self.k, self.v, *([self.k_scale, self.v_scale] if self.quantized else [])]

    def write(self, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        write_rows(self.k, self.k_scale, rows, k)
        write_rows(self.v, self.v_scale, rows, v)

    def read(self, table_rows: torch.Tensor, length: int,
             first_block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the first length positions of the listed slots, in the compute dtype
        (first_block: see kv_quant.gather_positions)."""
        return (read_positions(self.k, self.k_scale, table_rows, length, self.dtype, first_block),
                read_positions(self.v, self.v_scale, table_rows, length, self.dtype, first_block))


@dataclass
class StepIndex:
    token_slot: torch.Tensor  # [T] slot of each new token
    token_pos: torch.Tensor  # [T] position of each new token
    token_row: torch.Tensor  # [T] its row in the cache seen as [NB * BS, ...]
    seq_slot: torch.Tensor  # [B]
    seq_len: torch.Tensor  # [B] cached length after this step
    max_seq_len: int  # the longest of seq_len, known without reading the device
    block_table: torch.Tensor  # [S, M] int32


def step_index(ctx: Context, device: torch.device, slot_table: torch.Tensor | None, block_size: int) -> StepIndex:
    """The step's token and sequence indices over the paged cache: built once per step and device, then shared
    by every layer (kept on the context object). slot_table: the cache's own table, used when ctx has none."""
    memo = ctx.__dict__.setdefault("_attention_index", {})
    if device in memo:
        return memo[device]
    table = ctx.block_table if ctx.block_table is not None else slot_table
    if table is None:
        raise RuntimeError("the step's context has no block table and the KV cache no slot table")
    if ctx.decode is not None:
        d = ctx.decode  # fixed shapes: attend over pad_len positions whatever the lengths
        token_slot, token_pos, seq_slot, seq_len, longest = d.slots, d.lens - 1, d.slots, d.lens, d.pad_len
    else:
        lens = [ctx.seq_len(b) for b in range(ctx.num_seqs)]
        ends = [p0 + n for p0, n in zip(ctx.start_pos, lens)]
        token_slot = torch.tensor([s for s, n in zip(ctx.slot_ids, lens) for _ in range(n)], dtype=torch.long,
                                  device=device)
        token_pos = torch.tensor([p for p0, n in zip(ctx.start_pos, lens) for p in range(p0, p0 + n)],
                                 dtype=torch.long, device=device)
        seq_slot = torch.tensor(ctx.slot_ids, dtype=torch.long, device=device)
        seq_len, longest = torch.tensor(ends, dtype=torch.long, device=device), max(ends)
    if longest > table.shape[1] * block_size:
        raise RuntimeError(f"a sequence reaches {longest} tokens but its block table holds "
                           f"{table.shape[1] * block_size}")
    token_row = table[token_slot, token_pos // block_size].long() * block_size + token_pos % block_size
    memo[device] = StepIndex(token_slot, token_pos, token_row, seq_slot, seq_len, longest, table)
    return memo[device]


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Which keys each query sees: causal, and within the window (key > query - window) if any."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
    return mask


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache | None,
                     scale: float, sliding_window: int | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Write k, v into the cache, then attend each sequence's queries to its cached keys (torch ops).

    q [T, Hq, Dk], k [T, Hkv, Dk], v [T, Hkv, Dv] -> [T, Hq, Dv]. Without a cache every
    sequence must start at position 0 and attends to its own new tokens only. sinks [Hq]: gpt-oss's
    per-head sink logits (layers/sink_attention.py), or None.
    """
    ctx = get_context()
    if cache is None:
        if any(ctx.start_pos):
            raise RuntimeError("decoding past position 0 needs a KV cache: call allocate_kv_cache first")
        return _attend_uncached(q, k, v, ctx, scale, sliding_window, sinks)
    idx = _cache_index(ctx, cache, q.device)
    cache.write(idx.token_row, k, v)
    return _attend_cached(q, cache, ctx, idx, scale, sliding_window, sinks=sinks)


def _cache_index(ctx: Context, cache: KVCache, device: torch.device) -> StepIndex:
    return step_index(ctx, device, cache.slot_table, cache.block_size)


def _attend_cached(q, cache, ctx, idx, scale, sliding_window, fused: bool = False, sinks=None):
    """The step's queries q [T, Hq, Dk] over their sequences' caches, this step's keys already written.
    fused: a decode step in one Triton kernel (decode_attention_triton.py; q on CUDA), sinks [Hq] included."""
    if (ctx.decode is not None or ctx.is_decode) and fused:
        from hybridmoe.layers.decode_attention_triton import triton_decode_attention

        return triton_decode_attention(q, cache.k, cache.v, idx.block_table, idx.seq_slot, idx.seq_len, scale,
                                       sliding_window, idx.max_seq_len, cache.k_scale, cache.v_scale, sinks)
    if ctx.decode is not None or ctx.is_decode:
        first = ctx.first_block(0) if ctx.num_seqs == 1 else None
        return _attend_decode(q, cache, idx, scale, sliding_window, first, sinks)
    out = []
    for b in range(ctx.num_seqs):
        lo, hi = ctx.cu_seqlens[b], ctx.cu_seqlens[b + 1]
        end = ctx.start_pos[b] + (hi - lo)
        kb, vb = cache.read(idx.block_table[ctx.slot_ids[b]], end, ctx.first_block(b))
        if sinks is not None:
            out.append(attend_with_sinks(q[lo:hi], kb, vb, ctx.start_pos[b], scale, sinks, sliding_window))
            continue
        if sliding_window is None:  # the queries are the last hi - lo of the end positions
            out.append(_sdpa_causal(q[lo:hi], kb, vb, scale))
            continue
        q_pos = idx.token_pos[lo:hi]
        mask = _visible(q_pos, torch.arange(end, device=q.device), sliding_window)
        out.append(_sdpa(q[lo:hi], kb, vb, mask, scale))
    return torch.cat(out)


def _attend_uncached(q, k, v, ctx, scale, sliding_window, sinks=None):
    out = []
    for b in range(ctx.num_seqs):
        lo, hi = ctx.cu_seqlens[b], ctx.cu_seqlens[b + 1]
        if sinks is not None:
            out.append(attend_with_sinks(q[lo:hi], k[lo:hi], v[lo:hi], 0, scale, sinks, sliding_window))
            continue
        if sliding_window is None:
            out.append(_sdpa_causal(q[lo:hi], k[lo:hi], v[lo:hi], scale))
            continue
        pos = torch.arange(hi - lo, device=q.device)
        out.append(_sdpa(q[lo:hi], k[lo:hi], v[lo:hi], _visible(pos, pos, sliding_window), scale))
    return torch.cat(out)


def _sdpa(q, k, v, mask, scale):
    """One sequence: q [n, Hq, Dk], k [m, Hkv, Dk], v [m, Hkv, Dv], mask [n, m] bool -> [n, Hq, Dv]."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       attn_mask=mask, scale=scale, enable_gqa=True)
    return o.transpose(0, 1)


def _sdpa_causal(q, k, v, scale):
    """One sequence's n queries, its last n of m positions, over all its m keys, causal, no window:
    q [n, Hq, Dk], k [m, Hkv, Dk], v [m, Hkv, Dv] -> [n, Hq, Dv]. The lower-right causal bias (not a
    mask tensor, which keeps SDPA on its math path: fp32 GEMMs, 2.2 ms a Qwen3 layer at 512 tokens) and
    key/value heads repeated to the query heads let it take its flash kernels."""
    from torch.nn.attention.bias import causal_lower_right

    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    # [1, heads, rows, D]: the fused kernels take only 4-d inputs (3-d ones fell back to the math path)
    o = F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
                                       attn_mask=causal_lower_right(q.shape[0], k.shape[0]), scale=scale)
    return o[0].transpose(0, 1)


def _attend_decode(q, cache, idx, scale, sliding_window, first_block: int | None = None, sinks=None):
    """One new token per sequence over each sequence's cache up to the longest (or the padded length of a
    fixed-shape step), the rest masked: q [B, Hq, Dk] -> [B, Hq, Dv]. Each key/value head's G query heads are one
    matrix product against its keys, scores in float32 and probabilities rounded to the cache dtype before they
    weigh the values (as the Triton kernel does); on the CPU this runs 2.5-6x faster than SDPA, which expands
    the key/value heads. sinks [Hq]: one more logit per head in the softmax, which weighs no value."""
    max_len = idx.max_seq_len
    rows = idx.block_table[idx.seq_slot]  # [B, M]
    kb, vb = cache.read(rows, max_len, first_block)  # [B, L, Hkv, Dk], [B, L, Hkv, Dv]
    B, Hq, Dk = q.shape
    Hkv = kb.shape[2]
    k_pos = torch.arange(max_len, device=q.device)
    hidden = k_pos[None, :] >= idx.seq_len[:, None]  # [B, L]
    if sliding_window is not None:
        hidden |= k_pos[None, :] <= idx.token_pos[:, None] - sliding_window
    scores = q.view(B, Hkv, Hq // Hkv, Dk).float() @ kb.permute(0, 2, 3, 1).float()  # [B, Hkv, G, L]
    scores = (scores * scale).masked_fill(hidden[:, None, None, :], float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.float().view(1, Hkv, Hq // Hkv, 1).expand(B, -1, -1, 1)], dim=-1)
    probs = scores.softmax(dim=-1)[..., :max_len].to(vb.dtype)
    return (probs @ vb.transpose(1, 2)).reshape(B, Hq, vb.shape[-1])


class Attention(nn.Module):
    """Grouped-query attention with rotary embeddings; q/k/v checkpoint tensors load into qkv_proj.

    rope: the normalized rope dict (rope_type, rope_theta, ...). qk_norm_eps: Qwen3's per-head
    RMSNorm of queries and keys before rotary (None: no norm). qk_norm_per_head False: one RMSNorm over all
    of q's heads together and one over all of k's (MiniMax-M2: weights [Hq D] and [Hkv D]), before the split
    into heads. sliding_window: keys older than this many positions are not seen (None: full causal
    attention). rotary_dim: how many of each head's first dimensions rotate (GLM-4.5's partial rotary; None:
    all head_dim). The Triton kernels rotate whole heads and normalize per head, so a partial-rotary layer or
    one with whole-q/k norms runs its norms, rotary and cache writes as torch ops. sinks: a learned logit per
    query head joins each softmax and weighs no value (gpt-oss; parameter `sinks` [Hq], layers/sink_attention.py):
    a decode step's Triton kernels take them, a prefill attends with them in torch ops.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rope: dict, *, qkv_bias: bool = False, o_bias: bool = False, qk_norm_eps: float | None = None,
                 qk_norm_per_head: bool = True, sliding_window: int | None = None, rotary_dim: int | None = None,
                 sinks: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.sliding_window = sliding_window
        self.qkv_proj = MergedLinear(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim,
                                                   num_kv_heads * head_dim], bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=o_bias)
        self.qk_norm_per_head = qk_norm_per_head
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim if qk_norm_per_head else num_heads * head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim if qk_norm_per_head else num_kv_heads * head_dim, qk_norm_eps)
        self.rotary = RotaryEmbedding(rotary_dim or head_dim, rope)
        self.sinks = nn.Parameter(torch.empty(num_heads)) if sinks else None
        # the Triton kernels (rope_triton, decode_attention_triton) rotate whole heads and normalize per head
        self.fits_kernels = self.rotary.dim == head_dim and (qk_norm_per_head or qk_norm_eps is None)
        self.kv_cache: KVCache | None = None
        self.fused = True  # on CUDA: norms, rotary and cache writes in one kernel, decode attention in one
        # on CUDA, short steps: o_proj as the Triton GEMV (layers/linear.py); a decode step over at most
        # CHUNK cached positions: q/k norms, rotary, cache writes and attention in one kernel
        self.fused_layer = True

    def kv_bytes_per_token(self, quantized: bool = False) -> int:
        """Keys and values of one token: in the compute dtype, or float8 codes and a float32 scale per head."""
        if quantized:
            return 2 * self.num_kv_heads * (self.head_dim + 4)
        return 2 * self.num_kv_heads * self.head_dim * self.o_proj.weight.element_size()

    def allocate_kv_cache(self, num_blocks: int, block_size: int, slot_table: torch.Tensor | None = None,
                          quantized: bool = False) -> None:
        """A cache of num_blocks blocks of block_size positions (slot_table: contiguous_slot_table's, for steps
        whose context carries no block table; quantized: float8 with a scale per token and head)."""
        w = self.o_proj.weight
        self.kv_cache = KVCache(num_blocks, block_size, self.num_kv_heads, self.head_dim, self.head_dim, w.dtype,
                                w.device, slot_table, quantized)

    def forward(self, x: torch.Tensor | None, positions: torch.Tensor, qkv: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H], positions [T] -> [T, H]. qkv: qkv_proj(x) [T, (Hq + 2 Hkv) D] if the caller made it
        (DecoderLayer, with the norm before it in one kernel); x is then not read (None)."""
        if qkv is None:
            qkv = self.qkv_proj(x)
        t = qkv.shape[0]
        if (self.fused and HAVE_TRITON and qkv.is_cuda and self.kv_cache is not None and self.fits_kernels
                and (not self.kv_cache.quantized or kernels_read_fp8(qkv.device))):
            return self._o_proj(self._fused_attention(qkv, positions).reshape(t, self.num_heads * self.head_dim))
        o = cached_attention(*self._rotated(qkv, positions), self.kv_cache, self.scale, self.sliding_window,
                             self.sinks)
        return self._o_proj(o.reshape(t, self.num_heads * self.head_dim))

    def _rotated(self, qkv: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D], k, v [T, Hkv, D], q and k normalized (q/k norms) and rotated,
        in torch ops."""
        t = qkv.shape[0]
        cos, sin = self.rotary(positions, qkv.dtype)
        q, k, v = self.qkv_proj.split(qkv)
        norm = hasattr(self, "q_norm")
        if norm and not self.qk_norm_per_head:  # [T, Hq D] and [T, Hkv D], all heads in one norm each
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if norm and self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward_normed(self, h: torch.Tensor, norm: RMSNorm, positions: torch.Tensor) -> torch.Tensor:
        """forward(norm(h), positions), the norm folded into qkv_proj's decode GEMV where it runs (fused_layer)."""
        if decode_gemv(h, self.fused_layer, self.qkv_proj):
            return self(None, positions, qkv=norm_linear(h, self.qkv_proj, norm)[0])
        return self(norm(h), positions)

    def _o_proj(self, o: torch.Tensor) -> torch.Tensor:
        """o [T, Hq D] -> [T, H]: the decode GEMV in short steps on CUDA (fused_layer), else cuBLAS."""
        if decode_gemv(o, self.fused_layer, self.o_proj):
            return norm_linear(o, self.o_proj)[0]
        return self.o_proj(o)

    def _fused_attention(self, qkv: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """forward's path from qkv [T, (Hq + 2 Hkv) D] to the attention output [T, Hq, D], with q/k norms,
        rotary and the cache writes in one kernel, and a decode step's attention (with its sinks, if any) in another
        (or, with fused_layer, over at most CHUNK cached positions, all in one). A float8 cache takes the same kernels
        but the first: rope_triton's kernel writes keys and values as they are, so torch's ops rotate them
        and the cache quantizes them (KVCache.write)."""
        from hybridmoe.layers.decode_attention_triton import (
            CHUNK,
            triton_rope_decode_attention,
        )
        from hybridmoe.layers.rope_triton import triton_norm_rope_cache

        ctx, cache = get_context(), self.kv_cache
        idx = _cache_index(ctx, cache, qkv.device)
        norm = hasattr(self, "q_norm")
        norm_args = (self.q_norm.weight if norm else None, self.k_norm.weight if norm else None,
                     self.q_norm.eps if norm else 0.0, positions, self.rotary.inv_freq(qkv.device),
                     self.rotary.attention_scaling, cache.k, cache.v, idx.token_row)
        if self.fused_layer and (ctx.decode is not None or ctx.is_decode) and idx.max_seq_len <= CHUNK:
            return triton_rope_decode_attention(qkv, self.num_heads, self.num_kv_heads, self.head_dim, *norm_args,
                                                idx.block_table, idx.seq_slot, idx.seq_len, self.scale,
                                                self.sliding_window, cache.k_scale, cache.v_scale, self.sinks)
        if cache.quantized:
            q, k, v = self._rotated(qkv, positions)
            cache.write(idx.token_row, k, v)
        else:
            q = triton_norm_rope_cache(qkv, self.num_heads, self.num_kv_heads, self.head_dim, *norm_args)
        return _attend_cached(q, cache, ctx, idx, self.scale, self.sliding_window, fused=True, sinks=self.sinks)
