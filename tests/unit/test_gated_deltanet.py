"""The gated delta rule's chunked form and its one-step recurrence agree with each other (float64) and with
transformers' torch fallbacks (float32); the causal convolution continues from its state.

T tokens, H value heads, Dk, Dv key and value dims, Ch channels, K kernel.
"""

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from hybridmoe.layers.gated_deltanet import causal_conv1d, chunk_gated_delta_rule, gated_delta_step, l2_normalize

H, DK, DV = 3, 8, 12


def inputs(T: int, dtype=torch.float64, seed: int = 0, strong_decay: bool = False):
    """q (normalized and scaled), k (normalized) [T, H, Dk], v [T, H, Dv], g, beta [T, H], a state [H, Dk, Dv]."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (l2_normalize(torch.randn(T, H, DK, generator=gen, dtype=dtype)) for _ in range(2))
    v = torch.randn(T, H, DV, generator=gen, dtype=dtype)
    g = -torch.rand(T, H, generator=gen, dtype=dtype) * (30.0 if strong_decay else 1.5)
    beta = torch.rand(T, H, generator=gen, dtype=dtype)
    state = torch.randn(H, DK, DV, generator=gen, dtype=dtype)
    return q * DK ** -0.5, k, v, g, beta, state


def step_by_step(q, k, v, g, beta, state):
    """The recurrence one token at a time: o [T, H, Dv] and the final state."""
    out = []
    s = state[None]
    for t in range(q.shape[0]):
        o, s = gated_delta_step(q[t][None], k[t][None], v[t][None], g[t][None], beta[t][None], s)
        out.append(o[0])
    return torch.stack(out), s[0]


@pytest.mark.parametrize("T, chunk", [(150, 64), (64, 64), (5, 64), (37, 7), (20, 1)])
def test_chunked_prefill_from_a_state_then_decode_equals_the_recurrence(T, chunk):
    """A prefill of T tokens in chunks from a nonzero state, then 4 decode steps from where it ended, equal the
    recurrence run one token at a time over all T + 4 (float64)."""
    q, k, v, g, beta, state = inputs(T + 4)
    ref_out, ref_state = step_by_step(q, k, v, g, beta, state)
    out, s = chunk_gated_delta_rule(q[:T], k[:T], v[:T], g[:T], beta[:T], state.clone(), chunk)
    torch.testing.assert_close(out, ref_out[:T], atol=1e-10, rtol=1e-10)
    s = s[None]
    for t in range(T, T + 4):
        o, s = gated_delta_step(q[t][None], k[t][None], v[t][None], g[t][None], beta[t][None], s)
        torch.testing.assert_close(o[0], ref_out[t], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(s[0], ref_state, atol=1e-10, rtol=1e-10)


def test_a_decay_strong_enough_to_underflow_stays_finite():
    """Decays of exp(-30) per token: the chunked form exponentiates only differences <= 0, so nothing overflows."""
    q, k, v, g, beta, state = inputs(130, dtype=torch.float32, strong_decay=True)
    out, s = chunk_gated_delta_rule(q, k, v, g, beta, state.clone())
    ref_out, ref_state = step_by_step(q, k, v, g, beta, state)
    assert torch.isfinite(out).all() and torch.isfinite(s).all()
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, ref_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T", [1, 100, 150])
def test_equal_transformers_torch_fallbacks_with_value_heads_sharing_key_heads(T):
    """transformers' torch_chunk_gated_delta_rule (and its recurrent rule) take raw q, k and two value heads per
    key head; ours take them normalized, scaled and repeated to the value heads (as the layer hands them)."""
    gen = torch.Generator().manual_seed(1)
    hk, hv = 2, 4
    q, k = torch.randn(1, T, hk, DK, generator=gen), torch.randn(1, T, hk, DK, generator=gen)
    v = torch.randn(1, T, hv, DV, generator=gen)
    g, beta = -torch.rand(1, T, hv, generator=gen) * 2, torch.rand(1, T, hv, generator=gen)
    state = torch.randn(1, hv, DK, DV, generator=gen)
    ours_q = l2_normalize(q[0]).repeat_interleave(2, dim=1) * DK ** -0.5
    ours_k = l2_normalize(k[0]).repeat_interleave(2, dim=1)
    out, s = chunk_gated_delta_rule(ours_q, ours_k, v[0], g[0], beta[0], state[0].clone())
    for rule in (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule):
        ref_out, ref_state = rule(q, k, v, g, beta, initial_state=state.clone(), output_final_state=True,
                                  use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out, ref_out[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s, ref_state[0], atol=1e-5, rtol=1e-5)


def test_the_convolution_continues_from_its_state():
    """Tokens 0..9 in one call from zeros equal 0..5 then 6..9 from the state the first call left, equal one token
    at a time; each output is the kernel over the token and the K - 1 before it."""
    gen = torch.Generator().manual_seed(2)
    Ch, K = 5, 4
    x = torch.randn(1, 10, Ch, generator=gen, dtype=torch.float64)
    w = torch.randn(Ch, K, generator=gen, dtype=torch.float64)
    zeros = torch.zeros(1, Ch, K - 1, dtype=torch.float64)
    whole, last = causal_conv1d(x, w, zeros)
    padded = torch.cat([zeros.transpose(1, 2), x], dim=1)  # [1, K - 1 + 10, Ch]
    expected = torch.stack([(padded[0, t:t + K] * w.T).sum(0) for t in range(10)])
    torch.testing.assert_close(whole[0], expected)
    torch.testing.assert_close(last, x[:, -(K - 1):].transpose(1, 2))
    first, state = causal_conv1d(x[:, :6], w, zeros)
    second, state = causal_conv1d(x[:, 6:], w, state)
    torch.testing.assert_close(torch.cat([first, second], dim=1), whole)
    state, steps = zeros, []
    for t in range(10):
        out, state = causal_conv1d(x[:, t:t + 1], w, state)
        steps.append(out)
    torch.testing.assert_close(torch.cat(steps, dim=1), whole)
