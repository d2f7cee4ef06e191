"""The GPU share of a MoE layer as two Triton kernels that read only the routed experts' weights.

Grouped by expert: program (e, block of rows, block of slots) first reads the slots' expert ids,
and returns at once unless one of them is e, so an expert no slot routes to costs no weight reads,
and an expert several slots route to is read once per block of slots (up to BLOCK_S of them).
Shapes are fixed by T, K and E alone and nothing waits on the host: a CUDA graph captures it.

T tokens, K slots per token, S = T * K slots (row s is token s // K), E experts here,
H hidden, I expert intermediate size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK_S = 64
"""Most slots one program takes; more slots add programs along the grid's third axis."""


@triton.jit
def _gate_up_kernel(x_ptr, gate_ptr, up_ptr, sid_ptr, h_ptr, S, H, I, K,
                    stride_x, stride_we, stride_wi, stride_h,
                    BLOCK_S: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr,
                    PRECISION: tl.constexpr):
    """h[s, i-block] = silu(x[s // K] . gate[e, i]) * (x[s // K] . up[e, i]) for the slots s on expert e."""
    e = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)  # [BLOCK_I] intermediate rows
    slots = tl.program_id(2) * BLOCK_S + tl.arange(0, BLOCK_S)  # [BLOCK_S]
    sel = tl.load(sid_ptr + slots, mask=slots < S, other=-1) == e
    if tl.max(sel.to(tl.int32), axis=0) > 0:
        tok = slots // K
        acc_g = tl.zeros((BLOCK_S, BLOCK_I), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_S, BLOCK_I), dtype=tl.float32)
        w_off = e.to(tl.int64) * stride_we + rows[None, :] * stride_wi  # [1, BLOCK_I]
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            xs = tl.load(x_ptr + tok[:, None] * stride_x + cols[None, :],
                         mask=sel[:, None] & (cols[None, :] < H), other=0.0)  # [BLOCK_S, BLOCK_H]
            w_mask = (cols[:, None] < H) & (rows[None, :] < I)
            wg = tl.load(gate_ptr + w_off + cols[:, None], mask=w_mask, other=0.0)  # [BLOCK_H, BLOCK_I]
            wu = tl.load(up_ptr + w_off + cols[:, None], mask=w_mask, other=0.0)
            xs = xs.to(wg.dtype)
            acc_g = tl.dot(xs, wg, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(xs, wu, acc_u, input_precision=PRECISION)
        act = acc_g * tl.sigmoid(acc_g) * acc_u
        tl.store(h_ptr + slots[:, None] * stride_h + rows[None, :], act,
                 mask=sel[:, None] & (rows[None, :] < I))


@triton.jit
def _down_kernel(h_ptr, down_ptr, sid_ptr, w_ptr, y_ptr, S, H, I,
                 stride_h, stride_de, stride_dh, stride_y,
                 BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr,
                 PRECISION: tl.constexpr):
    """y[s, h-block] = w[s] * (down[e, h-block] . h[s]) for the slots s on expert e."""
    e = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H] hidden rows of down
    slots = tl.program_id(2) * BLOCK_S + tl.arange(0, BLOCK_S)
    sel = tl.load(sid_ptr + slots, mask=slots < S, other=-1) == e
    if tl.max(sel.to(tl.int32), axis=0) > 0:
        acc = tl.zeros((BLOCK_S, BLOCK_H), dtype=tl.float32)
        d_off = e.to(tl.int64) * stride_de + cols[None, :] * stride_dh  # [1, BLOCK_H]
        for i0 in range(0, I, BLOCK_I):
            inner = i0 + tl.arange(0, BLOCK_I)
            hs = tl.load(h_ptr + slots[:, None] * stride_h + inner[None, :],
                         mask=sel[:, None] & (inner[None, :] < I), other=0.0)  # [BLOCK_S, BLOCK_I]
            wd = tl.load(down_ptr + d_off + inner[:, None],
                         mask=(inner[:, None] < I) & (cols[None, :] < H), other=0.0)  # [BLOCK_I, BLOCK_H]
            acc = tl.dot(hs.to(wd.dtype), wd, acc, input_precision=PRECISION)
        scale = tl.load(w_ptr + slots, mask=sel, other=0.0)  # [BLOCK_S]
        tl.store(y_ptr + slots[:, None] * stride_y + cols[None, :], acc * scale[:, None],
                 mask=sel[:, None] & (cols[None, :] < H))


def triton_silu_experts(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                        ids: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum over slots with mask of weights * silu-gated expert_ids(x); float32 [T, H].

    x [T, H]; gate, up [E, I, H]; down [E, H, I] (contiguous, the model's dtype); ids [T, K] local
    to these E (anything where mask is False); weights [T, K]; mask [T, K] bool.
    """
    T, K = ids.shape
    E, I, H = gate.shape
    S = T * K
    sid = torch.where(mask, ids, -1).to(torch.int32).reshape(S)  # [S], -1: not on this GPU
    w = weights.float().reshape(S)
    xw = x.to(gate.dtype).contiguous()
    h = torch.empty(S, I, dtype=torch.float32, device=x.device)  # rows of slots not here stay unread
    y = torch.zeros(S, H, dtype=torch.float32, device=x.device)  # slots not here add 0
    block_s = min(MAX_BLOCK_S, max(16, triton.next_power_of_2(S)))  # tl.dot needs 16 rows
    # fp32 models keep fp32 products (tf32 would miss the reference by ~1e-3)
    precision = "ieee" if gate.dtype == torch.float32 else "tf32"
    slot_blocks = triton.cdiv(S, block_s)
    _gate_up_kernel[(E, triton.cdiv(I, 16), slot_blocks)](
        xw, gate, up, sid, h, S, H, I, K, xw.stride(0), gate.stride(0), gate.stride(1), h.stride(0),
        BLOCK_S=block_s, BLOCK_I=16, BLOCK_H=128, PRECISION=precision)
    _down_kernel[(E, triton.cdiv(H, 32), slot_blocks)](
        h, down, sid, w, y, S, H, I, h.stride(0), down.stride(0), down.stride(1), y.stride(0),
        BLOCK_S=block_s, BLOCK_H=32, BLOCK_I=64, PRECISION=precision)
    return y.view(T, K, H).sum(dim=1)
