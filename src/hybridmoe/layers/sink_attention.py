"""Attention with per-head sinks (gpt-oss), the torch op a prefill step runs.

A sink is one more logit in each head's softmax, a learned number per head that weighs no value: a head
whose keys all score low spends its weight on the sink instead of on them. So the probabilities over the
real keys sum to less than 1. A prefill step with sinks runs these torch ops (layers/attention.py); a decode step's
sinks join its softmax in the Triton decode kernels on CUDA (layers/decode_attention_triton.py), else in
_attend_decode.

One sequence: n queries at positions q_start .. q_start + n - 1 over its keys at positions 0 .. m - 1
(m = q_start + n), Hq query heads, Hkv key/value heads, G = Hq / Hkv query heads per key/value head,
Dk key dim, Dv value dim.
"""

from __future__ import annotations

import torch

SINK_BLOCK_SCORES = 1 << 24
"""Float32 scores one block of queries holds at most (64 MiB): a long prompt's queries go in blocks."""


def _query_rows(num_heads: int, num_keys: int, sliding_window: int | None) -> int:
    """Queries per block: a block of r queries sees at most min(m, r + window - 1) keys, so with r at most the
    window its scores [Hq, r, keys] stay within SINK_BLOCK_SCORES."""
    span = num_keys if sliding_window is None else min(num_keys, 2 * sliding_window)
    rows = max(1, SINK_BLOCK_SCORES // (num_heads * span))
    return rows if sliding_window is None else min(rows, sliding_window)


def attend_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, scale: float,
                      sinks: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """q [n, Hq, Dk], k [m, Hkv, Dk], v [m, Hkv, Dv], sinks [Hq] -> [n, Hq, Dv].

    Causal (a query sees keys at its position and before), within the window if any (key > query - window).
    Scores and the softmax in float32; the probabilities are rounded to v's dtype before they weigh the values
    (as transformers' eager attention does).
    """
    n, num_heads, dk = q.shape
    m, kv_heads, dv = v.shape
    groups = num_heads // kv_heads
    sink_logits = sinks.float().view(kv_heads, groups, 1, 1)
    rows = _query_rows(num_heads, m, sliding_window)
    out = []
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        first = 0 if sliding_window is None else max(0, q_start + lo - sliding_window + 1)
        last = q_start + hi  # the block's keys: first .. last - 1
        q_pos = torch.arange(q_start + lo, q_start + hi, device=q.device)
        k_pos = torch.arange(first, last, device=q.device)
        masked = k_pos[None, :] > q_pos[:, None]  # [r, keys]
        if sliding_window is not None:
            masked |= k_pos[None, :] <= q_pos[:, None] - sliding_window
        qb = q[lo:hi].reshape(hi - lo, kv_heads, groups, dk).permute(1, 2, 0, 3).float()  # [Hkv, G, r, Dk]
        kb = k[first:last].permute(1, 2, 0).float()  # [Hkv, Dk, keys]
        scores = (qb @ kb[:, None]) * scale  # [Hkv, G, r, keys]
        scores = scores.masked_fill(masked, float("-inf"))
        logits = torch.cat([scores, sink_logits.expand(-1, -1, hi - lo, 1)], dim=-1)
        probs = logits.softmax(dim=-1)[..., :-1].to(v.dtype)  # the sink's share weighs nothing
        ob = probs @ v[first:last].permute(1, 0, 2)[:, None]  # [Hkv, G, r, Dv]
        out.append(ob.permute(2, 0, 1, 3).reshape(hi - lo, num_heads, dv))
    return torch.cat(out)
