"""The GPU share of a MoE layer as two Triton kernels that read only the routed experts' weights.

The slots are sorted by expert and cut into blocks of BLOCK_S slots of one expert each (each
expert's run padded to a whole block), the way grouped MoE GEMMs are laid out; the number of
blocks is bounded by S / BLOCK_S + E, so every shape depends on T, K and E alone and nothing
waits on the host: a CUDA graph captures it. A program works on one block: it reads its
expert's rows once for up to BLOCK_S slots; the blocks past the last used one return at once, so
an expert no slot routes to costs no weight reads.

T tokens, K slots per token, S = T * K slots (slot s is token s // K), E experts here,
H hidden, I expert intermediate size, NB blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridmoe.experts.gpu_experts import block_size, slot_blocks


@triton.jit
def _gate_up_kernel(x_ptr, gate_ptr, up_ptr, block_expert_ptr, block_slots_ptr, h_ptr, H, I, K,
                    stride_x, stride_we, stride_wi, stride_h,
                    BLOCK_S: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr,
                    PRECISION: tl.constexpr):
    """h[s, i-block] = silu(x[s // K] . gate[e, i]) * (x[s // K] . up[e, i]) for the block's slots s."""
    block = tl.program_id(0)
    e = tl.load(block_expert_ptr + block)
    if e >= 0:
        rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)  # [BLOCK_I] intermediate rows
        slots = tl.load(block_slots_ptr + block * BLOCK_S + tl.arange(0, BLOCK_S))  # [BLOCK_S], -1: padding
        sel = slots >= 0
        tok = tl.where(sel, slots, 0) // K
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
        tl.store(h_ptr + tl.where(sel, slots, 0)[:, None] * stride_h + rows[None, :], act,
                 mask=sel[:, None] & (rows[None, :] < I))


@triton.jit
def _down_kernel(h_ptr, down_ptr, block_expert_ptr, block_slots_ptr, w_ptr, y_ptr, H, I,
                 stride_h, stride_de, stride_dh, stride_y,
                 BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr,
                 PRECISION: tl.constexpr):
    """y[s, h-block] = w[s] * (down[e, h-block] . h[s]) for the block's slots s."""
    block = tl.program_id(0)
    e = tl.load(block_expert_ptr + block)
    if e >= 0:
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H] hidden rows of down
        slots = tl.load(block_slots_ptr + block * BLOCK_S + tl.arange(0, BLOCK_S))
        sel = slots >= 0
        row = tl.where(sel, slots, 0)
        acc = tl.zeros((BLOCK_S, BLOCK_H), dtype=tl.float32)
        d_off = e.to(tl.int64) * stride_de + cols[None, :] * stride_dh  # [1, BLOCK_H]
        for i0 in range(0, I, BLOCK_I):
            inner = i0 + tl.arange(0, BLOCK_I)
            hs = tl.load(h_ptr + row[:, None] * stride_h + inner[None, :],
                         mask=sel[:, None] & (inner[None, :] < I), other=0.0)  # [BLOCK_S, BLOCK_I]
            wd = tl.load(down_ptr + d_off + inner[:, None],
                         mask=(inner[:, None] < I) & (cols[None, :] < H), other=0.0)  # [BLOCK_I, BLOCK_H]
            acc = tl.dot(hs.to(wd.dtype), wd, acc, input_precision=PRECISION)
        scale = tl.load(w_ptr + row, mask=sel, other=0.0)  # [BLOCK_S]
        tl.store(y_ptr + row[:, None] * stride_y + cols[None, :], acc * scale[:, None],
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
    sid = torch.where(mask, ids.long(), E).reshape(S)  # [S], E: not on this GPU
    block = block_size(S, E)
    block_expert, block_slots = slot_blocks(sid, E, block)
    NB = block_expert.numel()
    w = weights.float().reshape(S)
    xw = x.to(gate.dtype).contiguous()
    h = torch.empty(S, I, dtype=torch.float32, device=x.device)  # rows of slots not here stay unread
    y = torch.zeros(S, H, dtype=torch.float32, device=x.device)  # slots not here add 0
    # fp32 models keep fp32 products (tf32 would miss the reference by ~1e-3)
    precision = "ieee" if gate.dtype == torch.float32 else "tf32"
    _gate_up_kernel[(NB, triton.cdiv(I, 16))](
        xw, gate, up, block_expert, block_slots, h, H, I, K, xw.stride(0), gate.stride(0), gate.stride(1),
        h.stride(0), BLOCK_S=block, BLOCK_I=16, BLOCK_H=128, PRECISION=precision)
    _down_kernel[(NB, triton.cdiv(H, 32))](
        h, down, block_expert, block_slots, w, y, H, I, h.stride(0), down.stride(0), down.stride(1), y.stride(0),
        BLOCK_S=block, BLOCK_H=32, BLOCK_I=64, PRECISION=precision)
    return y.view(T, K, H).sum(dim=1)
