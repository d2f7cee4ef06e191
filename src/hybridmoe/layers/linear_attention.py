"""The Gated DeltaNet token mixer of Qwen3-Next's linear-attention layers, and its per-sequence state.

in_proj_qkvz gives, per key head, [q (Dk), k (Dk), v (r Dv), z (r Dv)] (r = Hv / Hk value heads share a key head);
in_proj_ba gives, per key head, [b (r), a (r)]. With flat_projections (Qwen3.5, whose checkpoints store in_proj_qkv,
in_proj_z, in_proj_b and in_proj_a) the rows are [q (Hk Dk), k (Hk Dk), v (Hv Dv), z (Hv Dv)] and [b (Hv), a (Hv)]:
the same values, each part holding all its heads in value-head order. q, k and v (all heads of each, in that order:
the convolution's channels) pass a depthwise causal convolution of kernel K and the activation; then the gated delta rule
(layers/gated_deltanet.py) with decay g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b), queries and keys
L2-normalized and repeated to the value heads; its output is RMS-normalized per value head, gated by silu(z)
(RMSNormGated) and projected by out_proj.

A sequence's history lives in two states instead of a KV cache: the convolution's last K - 1 inputs (compute dtype,
[Ch, K - 1]) and the rule's state (float32, [Hv, Dk, Dv]). allocate_state gives the layer one of each per slot (the
engine's sequence slots, forward_context.Context.slot_ids); a sequence's step that starts at position 0 starts from
zeros, any later one from what its slot holds, so a prompt's chunks and the decode steps after them continue one
another. Each slot also records how many positions it holds, and a step that does not continue them (a prefix served
from elsewhere without its state, a step dropped) is an error rather than a silently wrong state.

Snapshots (prefix caching, engine/state_snapshots.py): allocate_state also gives num_snapshots rows beside the slots.
A step's context may ask to keep a sequence's state after some of its new tokens in a snapshot (state_saves: the rule
then runs in segments split there, and the convolution's state there is its last K - 1 inputs), and to copy a
snapshot into a slot before the step (state_restores), so a sequence whose cached prefix ends where a snapshot was
taken continues from that state instead of computing the prefix again. A snapshot records its positions too.

On CUDA with triton (and fused, the default), the convolution, the heads and the rule run as the Triton kernels of
layers/gated_deltanet_triton.py, which read and rewrite the slots' states in place; else as the torch ops of
layers/gated_deltanet.py, the reference the device tests hold the kernels to. A prefill with state_saves runs the
kernels in rounds, one call each: round j takes the j-th segment (split at the saves) of every sequence that has one
(a call's sequences sit on distinct slots, so a sequence's segments go to successive calls), and after it the slots
whose segment ends at a save are copied into their snapshots.

A fixed-shape decode step (the context's DecodeBatch, what a CUDA graph replays) reads its rows' slots from the
device and starts a row from zeros where its length is 1 (lens > 1: it continues its slot), so nothing is read on the
host. Its host share (the restores, the positions check before it; the positions and the saves after it:
DeltaNetState.begin_step and end_decode_step) runs outside it, by whoever launches it (engine/model_runner.py): a
graph's replay runs none of this Python. Its padding rows name a spare slot and start from zeros, so they read no
state, and what they write there nothing reads.

T tokens, H hidden, B sequences, Hk key heads, Hv value heads, Dk, Dv their dims, Ch = 2 Hk Dk + Hv Dv, K kernel, S
slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hybridmoe.forward_context import Context, get_context
from hybridmoe.layers.gated_deltanet import (
    DEFAULT_CHUNK,
    causal_conv1d,
    chunk_gated_delta_rule,
    gated_delta_step,
    l2_normalize,
)
from hybridmoe.layers.linear import MergedLinear
from hybridmoe.layers.mlp import get_activation
from hybridmoe.platform import HAVE_TRITON

TRITON_ON_CPU = False
"""Whether CPU tensors take the Triton kernels too, which only Triton's interpreter (TRITON_INTERPRET=1) runs there:
how tests/device drive the layer's Triton path without a GPU. Off: CPU tensors take the torch ops."""


class RMSNormGated(nn.Module):
    """RMSNorm of x scaled by weight (rounded to x's dtype first), times silu(gate) in float32, rounded once."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (normed * F.silu(gate.float())).to(x.dtype)


class DeltaNetState:
    """One layer's state per slot and per snapshot: conv [S + N, Ch, K - 1] in the compute dtype, recurrent
    [S + N, Hv, Dk, Dv] float32 (rows 0..S-1 the slots, S + i snapshot i), and the positions each row holds
    (host-side)."""

    def __init__(self, num_slots: int, num_snapshots: int, channels: int, kernel: int, heads: int, k_dim: int,
                 v_dim: int, dtype: torch.dtype, device: torch.device):
        rows = num_slots + num_snapshots
        self.num_slots, self.num_snapshots = num_slots, num_snapshots
        self.conv = torch.zeros(rows, channels, kernel - 1, dtype=dtype, device=device)
        self.recurrent = torch.zeros(rows, heads, k_dim, v_dim, dtype=torch.float32, device=device)
        self.positions = [0] * rows

    def begin_step(self, ctx: Context) -> None:
        """The host's share before a step: the context's restores copied into their slots, then the check that
        every sequence continues its slot."""
        self.restore(ctx.state_restores)
        self.check(ctx)

    def end_decode_step(self, ctx: Context) -> None:
        """The host's share after a decode step (one token each): the positions advanced, and each save of the
        context keeps the state after the token, what the slot holds now."""
        self.advance(ctx)
        self.keep([(ctx.slot_ids[b], snapshot, ctx.start_pos[b] + 1) for b, _, snapshot in ctx.state_saves])

    def check(self, ctx: Context) -> None:
        """Every sequence of the step starts at 0 or where its slot's state ends."""
        for slot, start in zip(ctx.slot_ids, ctx.start_pos):
            if start and self.positions[slot] != start:
                raise RuntimeError(f"slot {slot}'s recurrent state holds {self.positions[slot]} positions and the "
                                   f"step starts at {start}: a stateful layer continues only the step before it")

    def advance(self, ctx: Context) -> None:
        for b, (slot, start) in enumerate(zip(ctx.slot_ids, ctx.start_pos)):
            self.positions[slot] = start + ctx.seq_len(b)

    def snapshot_row(self, snapshot: int) -> int:
        if not 0 <= snapshot < self.num_snapshots:
            raise RuntimeError(f"snapshot {snapshot} is outside the {self.num_snapshots} that allocate_state gave")
        return self.num_slots + snapshot

    def restore(self, restores: list[tuple[int, int]]) -> None:
        """Copy each (slot, snapshot)'s snapshot into its slot (distinct slots)."""
        self._copy([(self.snapshot_row(snapshot), slot) for slot, snapshot in restores])

    def save(self, snapshot: int, conv: torch.Tensor, recurrent: torch.Tensor, positions: int) -> None:
        """Keep conv [Ch, K - 1] and recurrent [Hv, Dk, Dv], the state after `positions` tokens, in a snapshot."""
        row = self.snapshot_row(snapshot)
        self.conv[row] = conv
        self.recurrent[row] = recurrent
        self.positions[row] = positions

    def keep(self, saves: list[tuple[int, int, int]]) -> None:
        """Keep each (slot, snapshot, positions)'s slot state, as it is (the state after that many positions), in its
        snapshot (distinct snapshots)."""
        self._copy([(slot, self.snapshot_row(snapshot)) for slot, snapshot, _ in saves])
        for _, snapshot, positions in saves:
            self.positions[self.snapshot_row(snapshot)] = positions

    def copy_rows(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the conv and recurrent states of rows [n] (device indices), for put_rows to write back."""
        return self.conv[rows], self.recurrent[rows]

    def put_rows(self, rows: torch.Tensor, states: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Write copy_rows' states back into rows (the same indices)."""
        self.conv[rows], self.recurrent[rows] = states

    def _copy(self, pairs: list[tuple[int, int]]) -> None:
        """Row src's state and positions into row dst, for each (src, dst)."""
        if not pairs:
            return
        src, dst = (torch.tensor(rows, device=self.conv.device) for rows in zip(*pairs))
        self.conv[dst] = self.conv[src]
        self.recurrent[dst] = self.recurrent[src]
        for s, d in pairs:
            self.positions[d] = self.positions[s]


class GatedDeltaNet(nn.Module):
    """Parameters as the checkpoint names them: in_proj_qkvz, in_proj_ba, conv1d.weight [Ch, 1, K], dt_bias and A_log
    [Hv], norm.weight [Dv], out_proj. flat_projections: in_proj_qkvz merges in_proj_qkv and in_proj_z, in_proj_ba
    merges in_proj_b and in_proj_a (MergedLinear shards, in that order)."""

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, k_dim: int, v_dim: int, kernel: int,
                 eps: float, activation: str = "silu", chunk_size: int = DEFAULT_CHUNK, flat_projections: bool = False):
        super().__init__()
        self.num_k_heads, self.num_v_heads, self.k_dim, self.v_dim = num_k_heads, num_v_heads, k_dim, v_dim
        self.chunk_size = chunk_size
        self.channels = 2 * num_k_heads * k_dim + num_v_heads * v_dim
        self.flat_projections = flat_projections
        if flat_projections:
            self.in_proj_qkvz = MergedLinear(hidden_size, [self.channels, num_v_heads * v_dim])
            self.in_proj_ba = MergedLinear(hidden_size, [num_v_heads, num_v_heads])
        else:
            self.in_proj_qkvz = nn.Linear(hidden_size, self.channels + num_v_heads * v_dim, bias=False)
            self.in_proj_ba = nn.Linear(hidden_size, 2 * num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.channels, self.channels, kernel, groups=self.channels, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = RMSNormGated(v_dim, eps)
        self.out_proj = nn.Linear(num_v_heads * v_dim, hidden_size, bias=False)
        self.act = get_activation(activation)
        self.state: DeltaNetState | None = None
        self.fused = True  # the Triton kernels where they run (the module docstring); fuse_decode_kernels switches it

    def state_bytes(self) -> int:
        """Bytes of one slot's state: the convolution's inputs and the rule's float32 state."""
        kernel = self.conv1d.kernel_size[0]
        return (self.channels * (kernel - 1) * self.out_proj.weight.element_size()
                + self.num_v_heads * self.k_dim * self.v_dim * 4)

    def allocate_state(self, num_slots: int, num_snapshots: int = 0) -> None:
        """A state per slot, and num_snapshots snapshot rows beside them (zeros)."""
        w = self.out_proj.weight
        self.state = DeltaNetState(num_slots, num_snapshots, self.channels, self.conv1d.kernel_size[0],
                                   self.num_v_heads, self.k_dim, self.v_dim, w.dtype, w.device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H], each sequence of the step context continuing its slot's state (after the context's
        state_restores), and keeping it in snapshots where the context's state_saves ask. A fixed-shape decode
        step (ctx.decode) does only its device share (the module docstring)."""
        ctx = get_context()
        fixed = ctx.decode is not None
        if self.state is None and (fixed or any(ctx.start_pos) or ctx.state_restores or ctx.state_saves):
            raise RuntimeError("decoding past position 0, a fixed-shape decode step or a state snapshot needs the "
                               "recurrent state: call allocate_state first")
        if self.state is not None and not fixed:
            self.state.begin_step(ctx)
        t = x.shape[0]
        mixed, z, b, a = self._project(x)
        beta = b.sigmoid()  # [T, Hv]
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [T, Hv]
        if fixed:
            o = self._decode(mixed, g, beta, ctx.decode.slots, ctx.decode.lens > 1)
        elif ctx.is_decode and self.state is not None:
            going = torch.tensor([p > 0 for p in ctx.start_pos], device=mixed.device)  # False: starts from zeros
            o = self._decode(mixed, g, beta, ctx.slot_tensor(mixed.device), going)
            self.state.end_decode_step(ctx)
        else:
            prefill = self._prefill_kernels if self._kernels(mixed) else self._prefill
            o = prefill(mixed, g, beta, ctx)
            if self.state is not None:
                self.state.advance(ctx)
        o = self.norm(o.to(x.dtype), z.reshape(t, self.num_v_heads, self.v_dim))
        return self.out_proj(o.reshape(t, -1))

    def _kernels(self, mixed: torch.Tensor) -> bool:
        """Whether this step runs the Triton kernels (the module docstring)."""
        return self.fused and HAVE_TRITON and (mixed.is_cuda or TRITON_ON_CPU)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> the convolution's input [T, Ch] (all q heads, all k heads, all v heads), z [T, Hv Dv], b and a
        [T, Hv], from either row layout of the input projections."""
        t, hv = x.shape[0], self.num_v_heads
        if self.flat_projections:
            mixed, z = self.in_proj_qkvz.split(self.in_proj_qkvz(x))
            b, a = self.in_proj_ba.split(self.in_proj_ba(x))
            return mixed, z, b, a
        hk, r = self.num_k_heads, hv // self.num_k_heads
        q, k, v, z = self.in_proj_qkvz(x).view(t, hk, -1).split([self.k_dim, self.k_dim, r * self.v_dim,
                                                                  r * self.v_dim], dim=-1)
        b, a = self.in_proj_ba(x).view(t, hk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed, z.reshape(t, -1), b.reshape(t, hv), a.reshape(t, hv)

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's output [..., Ch] -> q, k [..., Hv, Dk] (L2-normalized in float32, q scaled by Dk^-1/2,
        each key head repeated to its r value heads) and v [..., Hv, Dv]."""
        lead, hk, r = mixed.shape[:-1], self.num_k_heads, self.num_v_heads // self.num_k_heads
        q, k, v = mixed.split([hk * self.k_dim, hk * self.k_dim, self.num_v_heads * self.v_dim], dim=-1)
        q, k = (l2_normalize(t.reshape(*lead, hk, self.k_dim).float()).repeat_interleave(r, dim=-2) for t in (q, k))
        return q * self.k_dim ** -0.5, k, v.reshape(*lead, self.num_v_heads, self.v_dim)

    def _prefill(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, ctx: Context) -> torch.Tensor:
        """The step's sequences one by one through the torch ops (_prefill_sequence) -> [T, Hv, Dv] float32."""
        saves = _saves_by_sequence(ctx)
        return torch.cat([self._prefill_sequence(mixed[lo:hi], g[lo:hi], beta[lo:hi], slot, start, saves.get(b, []))
                          for b, (lo, hi, slot, start) in enumerate(zip(ctx.cu_seqlens, ctx.cu_seqlens[1:],
                                                                        ctx.slot_ids, ctx.start_pos))])

    def _prefill_sequence(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slot: int, start: int,
                          saves: list[tuple[int, int]]) -> torch.Tensor:
        """One sequence's n new tokens (mixed [n, Ch], g, beta [n, Hv]) from its slot's state (zeros at position
        0), which then holds the state after them -> the rule's output [n, Hv, Dv] float32. saves: (tokens, snapshot)
        in strictly increasing order, 0 < tokens <= n: the state after that many of the tokens goes into the
        snapshot."""
        kernel = self.conv1d.kernel_size[0]
        if start == 0 or self.state is None:
            conv = mixed.new_zeros(1, self.channels, kernel - 1)
            rec = mixed.new_zeros(self.num_v_heads, self.k_dim, self.v_dim, dtype=torch.float32)
        else:
            conv, rec = self.state.conv[slot:slot + 1], self.state.recurrent[slot]
        before = conv[0]  # the convolution's inputs before the step's [Ch, K - 1]
        out, conv = causal_conv1d(mixed[None], self.conv1d.weight[:, 0], conv)
        q, k, v = self._heads(self.act(out[0]))
        outs, lo = [], 0
        for hi, snapshot in saves:  # the rule in segments that end where a snapshot is kept
            o, rec = chunk_gated_delta_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], rec, self.chunk_size)
            outs.append(o)
            self.state.save(snapshot, _last_inputs(before, mixed, hi), rec, start + hi)
            lo = hi
        if lo < q.shape[0]:
            o, rec = chunk_gated_delta_rule(q[lo:], k[lo:], v[lo:], g[lo:], beta[lo:], rec, self.chunk_size)
            outs.append(o)
        if self.state is not None:
            self.state.conv[slot] = conv[0]
            self.state.recurrent[slot] = rec
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _prefill_kernels(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, ctx: Context) -> torch.Tensor:
        """The step's sequences through the Triton prefill, in rounds of segments split at the context's saves (the
        module docstring) -> [T, Hv, Dv] float32; each slot then holds its sequence's state after its tokens."""
        from hybridmoe.layers.gated_deltanet_triton import triton_chunk_gated_delta_rule

        weight, device = self.conv1d.weight[:, 0], mixed.device
        if self.state is None:  # nothing kept: every sequence starts at 0, on scratch states of its own
            b = ctx.num_seqs
            conv = mixed.new_empty(b, self.channels, weight.shape[1] - 1)
            rec = torch.empty(b, self.num_v_heads, self.k_dim, self.v_dim, dtype=torch.float32, device=device)
            return triton_chunk_gated_delta_rule(mixed, g, beta, weight, conv, rec, torch.arange(b, device=device),
                                                 ctx.cu_seqlens, self.num_k_heads,
                                                 torch.zeros(b, dtype=torch.bool, device=device))
        if not ctx.state_saves:  # one round: the step's rows as they are
            return triton_chunk_gated_delta_rule(mixed, g, beta, weight, self.state.conv, self.state.recurrent,
                                                 ctx.slot_tensor(device), ctx.cu_seqlens, self.num_k_heads,
                                                 torch.tensor([p > 0 for p in ctx.start_pos], device=device))
        o = torch.empty(mixed.shape[0], self.num_v_heads, self.v_dim, dtype=torch.float32, device=device)
        for segments in _segment_rounds(ctx):
            rows = torch.tensor([i for s in segments for i in range(s.lo, s.hi)], dtype=torch.long, device=device)
            cu = [0]
            for s in segments:
                cu.append(cu[-1] + s.hi - s.lo)
            slots = torch.tensor([s.slot for s in segments], device=device)
            flags = torch.tensor([s.continues for s in segments], device=device)
            o[rows] = triton_chunk_gated_delta_rule(mixed[rows], g[rows], beta[rows], weight, self.state.conv,
                                                    self.state.recurrent, slots, cu, self.num_k_heads, flags)
            self.state.keep([(s.slot, s.snapshot, s.positions) for s in segments if s.snapshot is not None])
        return o

    def _decode(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, slots: torch.Tensor,
                going: torch.Tensor) -> torch.Tensor:
        """One token of each of B rows (mixed [B, Ch], g, beta [B, Hv]) in one recurrent step over the states of
        slots [B] (device; the Triton kernels want them distinct but for rows that start from zeros), starting from
        zeros where going [B] (bool, device) is False -> [B, Hv, Dv] float32. Reads nothing on the host."""
        if self._kernels(mixed):
            from hybridmoe.layers.gated_deltanet_triton import triton_gated_delta_decode

            return triton_gated_delta_decode(mixed, g, beta, self.conv1d.weight[:, 0], self.state.conv,
                                             self.state.recurrent, slots, self.num_k_heads, going)
        conv = torch.where(going[:, None, None], self.state.conv[slots], 0)
        rec = torch.where(going[:, None, None, None], self.state.recurrent[slots], 0)
        out, conv = causal_conv1d(mixed[:, None], self.conv1d.weight[:, 0], conv)
        q, k, v = self._heads(self.act(out[:, 0]))
        o, rec = gated_delta_step(q, k, v, g, beta, rec)
        self.state.conv[slots] = conv
        self.state.recurrent[slots] = rec
        return o


@dataclass(frozen=True)
class _Segment:
    """Rows lo .. hi - 1 of a step: part of one sequence's new tokens, on its slot, continuing the slot's state (else
    from zeros); the slot's state after them, the state after `positions` positions, goes into snapshot (None: no
    snapshot)."""

    lo: int
    hi: int
    slot: int
    continues: bool
    snapshot: int | None
    positions: int


def _saves_by_sequence(ctx: Context) -> dict[int, list[tuple[int, int]]]:
    """The context's state_saves as sequence -> [(tokens, snapshot), ...]."""
    saves: dict[int, list[tuple[int, int]]] = {}
    for b, offset, snapshot in ctx.state_saves:
        saves.setdefault(b, []).append((offset, snapshot))
    return saves


def _segment_rounds(ctx: Context) -> list[list[_Segment]]:
    """Each sequence's new tokens split at its saves (the last segment ends at its last token, or at its last save
    when that is its last token) -> rounds: round j holds the j-th segment of every sequence that has one."""
    saves = _saves_by_sequence(ctx)
    rounds: list[list[_Segment]] = []
    for b, (lo, hi, slot, start) in enumerate(zip(ctx.cu_seqlens, ctx.cu_seqlens[1:], ctx.slot_ids, ctx.start_pos)):
        ends = saves.get(b, [])
        if not ends or ends[-1][0] < hi - lo:
            ends = [*ends, (hi - lo, None)]
        done = 0
        for j, (end, snapshot) in enumerate(ends):
            if j == len(rounds):
                rounds.append([])
            rounds[j].append(_Segment(lo + done, lo + end, slot, j > 0 or start > 0, snapshot, start + end))
            done = end
    return rounds


def _last_inputs(before: torch.Tensor, mixed: torch.Tensor, n: int) -> torch.Tensor:
    """The convolution's state after the first n of a step's inputs mixed [T, Ch], which followed the inputs before
    [Ch, K - 1]: the last K - 1 of them all, [Ch, K - 1]."""
    keep = before.shape[-1]
    if n >= keep:
        return mixed[n - keep:n].t()
    return torch.cat([before[:, n:].to(mixed.dtype), mixed[:n].t()], dim=-1)
