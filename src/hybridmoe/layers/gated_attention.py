"""Grouped-query attention with an output gate (Qwen3-Next's full-attention layers).

q_proj yields, per query head, the query and a gate of head_dim each ([T, Hq, 2 D]: query first); the attention
output is multiplied by sigmoid(gate) before o_proj. Queries and keys are normalized per head by a zero-centred
RMSNorm (scale 1 + weight, layers/norm.py) and rotated over their first rotary_dim dimensions. The paged KV cache,
its step index and the attention over it are Attention's (layers/attention.py); the norms, rotary and attention run
as torch ops on every device, since the Triton kernels fuse neither the gate nor the (1 + weight) norms.

T tokens, H hidden, Hq query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import torch

from hybridmoe.layers.attention import Attention, cached_attention
from hybridmoe.layers.linear import MergedLinear
from hybridmoe.layers.norm import ZeroCenteredRMSNorm
from hybridmoe.layers.rotary import apply_rotary


class GatedAttention(Attention):
    """Checkpoint tensors q_proj [2 Hq D, H] (query and gate, interleaved per head), k_proj and v_proj load into
    qkv_proj; q_norm, k_norm [D]; o_proj. bias: on all four projections (config.json attention_bias)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, rope: dict, *,
                 bias: bool, norm_eps: float, rotary_dim: int):
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, rope, qkv_bias=bias, o_bias=bias,
                         rotary_dim=rotary_dim)
        self.qkv_proj = MergedLinear(hidden_size, [2 * num_heads * head_dim, num_kv_heads * head_dim,
                                                   num_kv_heads * head_dim], bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(head_dim, norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(head_dim, norm_eps)
        self.fits_kernels = False

    def forward(self, x: torch.Tensor | None, positions: torch.Tensor, qkv: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H], positions [T] -> [T, H] (qkv: qkv_proj(x) if the caller made it)."""
        if qkv is None:
            qkv = self.qkv_proj(x)
        t, width = qkv.shape[0], self.num_heads * self.head_dim
        q_gate, k, v = self.qkv_proj.split(qkv)
        q, gate = q_gate.view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))
        cos, sin = self.rotary(positions, qkv.dtype)
        o = cached_attention(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin),
                             v.view(t, self.num_kv_heads, self.head_dim), self.kv_cache, self.scale)
        return self._o_proj(o.reshape(t, width) * torch.sigmoid(gate.reshape(t, width)))

    def forward_normed(self, h: torch.Tensor, norm, positions: torch.Tensor) -> torch.Tensor:
        """forward(norm(h), positions): the norm stays its own op (the fused norm-GEMV scales by the weight itself,
        not by 1 + weight)."""
        return self(norm(h), positions)
