"""The gated delta rule (Gated DeltaNet) and the short causal convolution before it, as torch ops: the chunked
form a prefill runs and the one-step recurrence a decode step runs, each from a given state.

Per value head the state S [Dk, Dv] maps keys to values. Token t, with its key k_t and query q_t (L2-normalized, the
query also scaled by Dk^-1/2), value v_t, log-decay g_t <= 0 and write strength beta_t in (0, 1), does
    S <- exp(g_t) S
    S <- S + k_t (beta_t (v_t - S^T k_t))^T      (the delta rule: write what S does not predict yet)
    o_t = S^T q_t
The chunked form computes the same with matrix products over chunks of C tokens. In a chunk that starts from S_0,
with G_i = g_1 + ... + g_i, the writes u_i = beta_i (v_i - S_{i-1}'^T k_i) (S_{i-1}' decayed by exp(g_i)) solve the
unit lower-triangular system
    u_i + sum_{j<i} beta_i exp(G_i - G_j) (k_i . k_j) u_j = beta_i (v_i - exp(G_i) S_0^T k_i),
after which o_i = exp(G_i) S_0^T q_i + sum_{j<=i} exp(G_i - G_j) (q_i . k_j) u_j and
S_C = exp(G_C) S_0 + sum_j exp(G_C - G_j) k_j u_j^T. Only differences G_i - G_j with j <= i are exponentiated, so
nothing overflows however strong the decay.

T tokens, B sequences, H value heads, Dk key dim, Dv value dim, n tokens of a chunk, Ch convolution channels, K the
convolution's kernel length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DEFAULT_CHUNK = 64
"""Tokens per chunk of the chunked rule (transformers' and FLA's chunk length)."""


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the FLA kernels' eps placement, which transformers follows)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A depthwise causal convolution over each sequence's new tokens, continuing from its last K - 1 inputs.

    x [B, T, Ch] (the new tokens), weight [Ch, K], state [B, Ch, K - 1] (the inputs before them; zeros at a
    sequence's start) -> (out [B, T, Ch] before any activation, the new state [B, Ch, K - 1]: the last K - 1
    inputs)."""
    window = torch.cat([state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [B, Ch, K - 1 + T]
    out = F.conv1d(window, weight.unsqueeze(1), groups=weight.shape[0])  # [B, Ch, T]
    return out.transpose(1, 2), window[..., window.shape[-1] - state.shape[-1]:]


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences through the rule, in the state's dtype.

    q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H], state [B, H, Dk, Dv] -> (o [B, H, Dv], the new state)."""
    dtype = state.dtype
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    s = state * g.exp()[..., None, None]
    predicted = torch.einsum("bhk,bhkv->bhv", k, s)
    write = beta[..., None] * (v - predicted)
    s = s + k[..., :, None] * write[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q, s), s


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor, chunk_size: int = DEFAULT_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """T tokens of one sequence through the rule in chunks of chunk_size (the last one shorter), in the state's
    dtype.

    q, k [T, H, Dk], v [T, H, Dv], g, beta [T, H], state [H, Dk, Dv] -> (o [T, H, Dv], the state after the T
    tokens)."""
    dtype = state.dtype
    q, k, v = (t.to(dtype).transpose(0, 1) for t in (q, k, v))  # [H, T, D]
    g, beta = (t.to(dtype).transpose(0, 1) for t in (g, beta))  # [H, T]
    out = []
    for lo in range(0, q.shape[1], chunk_size):
        hi = lo + chunk_size
        o, state = _chunk(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi], state)
        out.append(o)
    return torch.cat(out, dim=1).transpose(0, 1), state


def _chunk(q, k, v, g, beta, state):
    """One chunk of n tokens: q, k [H, n, Dk], v [H, n, Dv], g, beta [H, n], state [H, Dk, Dv] (the module
    docstring's equations)."""
    n = q.shape[1]
    G = g.cumsum(dim=-1)  # [H, n]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    decay = (G[:, :, None] - G[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # [H, n, n], 0 above
    system = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)  # below the unit diagonal
    rhs = beta[..., None] * (v - G.exp()[..., None] * (k @ state))  # [H, n, Dv]
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    o = G.exp()[..., None] * (q @ state) + ((q @ k.transpose(-1, -2)) * decay) @ u
    to_end = (G[:, -1:] - G).exp()  # [H, n]: each token's decay to the chunk's end
    state = G[:, -1].exp()[:, None, None] * state + (k * to_end[..., None]).transpose(-1, -2) @ u
    return o, state
