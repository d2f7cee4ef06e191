"""The GPU share of a MoE layer as two Triton kernels that read only the routed experts' weights.

Two ways to hand programs their slots, both in shapes fixed by T, K and E with nothing waiting on
the host (a CUDA graph captures either):
- expert-major (S <= MAX_EXPERT_MAJOR_SLOTS, decode): program e reads the S slots' expert ids and
  works on those that are e; an expert no slot routes to returns after reading S ids. Each routed
  expert's weights are read exactly once, and the only other work is a few tiny torch ops.
- sorted blocks (longer steps, prefill): the slots are sorted by expert and cut into blocks of
  BLOCK_S slots of one expert each (slot_blocks in gpu_experts.py), so an expert's weights are read
  once per BLOCK_S of its slots; building the blocks takes a few dozen tiny torch ops, which a
  long step does not notice.

T tokens, K slots per token, S = T * K slots (slot s is token s // K), E experts here,
H hidden, I expert intermediate size, NB blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridmoe.experts.gpu_experts import block_size, slot_blocks

MAX_EXPERT_MAJOR_SLOTS = 64
"""Steps of at most this many slots (a batch of 8 with 8 experts per token) run expert-major: one
block of slots that every expert's programs scan."""


@triton.jit
def _program_slots(block_expert_ptr, block_slots_ptr, S, BLOCK_S: tl.constexpr, EXPERT_MAJOR: tl.constexpr):
    """This program's expert, its BLOCK_S slot indices and which of them it works on (sel).

    EXPERT_MAJOR: block_slots_ptr holds each slot's expert id [S] (-1: not here) and program b is
    expert b. Otherwise block_expert [NB] and block_slots [NB, BLOCK_S] from slot_blocks.
    """
    b = tl.program_id(0)
    if EXPERT_MAJOR:
        slots = tl.arange(0, BLOCK_S)
        sel = tl.load(block_slots_ptr + slots, mask=slots < S, other=-1) == b
        e = b
    else:
        slots = tl.load(block_slots_ptr + b * BLOCK_S + tl.arange(0, BLOCK_S))  # -1: padding
        sel = slots >= 0
        e = tl.load(block_expert_ptr + b)
    return e, tl.where(sel, slots, 0), sel


@triton.jit
def _weight_tile(w_ptr, scale_ptr, zero_ptr, e, rows, cols, N, K, stride_we, stride_wn, Kp, group,
                 FORMAT: tl.constexpr, ZERO: tl.constexpr):
    """Weights (row n, column k) of expert e for n in rows, k in cols, as a [len(cols), len(rows)] tile.

    FORMAT 0: a dense [E, N, K] tensor (strides stride_we, stride_wn), as it is. 4 / 8: the packed int4 /
    int8 layout of experts/packed_gpu.py (32-row blocks; packed_triton.py's byte formulas), dequantized
    to float32 as the CPU engine does: (code - zero) * scale, zero 8 when symmetric; int8 code * scale.
    """
    kk = cols[:, None]  # [BK, 1]
    nn = rows[None, :]  # [1, BN]
    mask = (kk < K) & (nn < N)
    # one return, after constexpr branches only (triton compiles just the branch taken)
    if FORMAT == 0:
        tile = tl.load(w_ptr + e * stride_we + nn * stride_wn + kk, mask=mask, other=0.0)
    else:
        blk = e * ((N + 31) // 32) + nn // 32  # the block among all experts' blocks
        r = nn % 32
        if FORMAT == 4:
            k8 = kk % 8
            byte = ((((kk // 8) * 2 + r // 16) * 2 + (k8 % 4) // 2) * 16 + r % 16) * 2 + k8 % 2
            raw = tl.load(w_ptr + blk * (16 * Kp) + byte, mask=mask, other=0).to(tl.int32)
            code = (raw >> ((k8 // 4) * 4)) & 0xF
            s_off = (blk * (Kp // group) + kk // group) * 32 + r  # scales [block][group][32]
            scale = tl.load(scale_ptr + s_off, mask=mask, other=0.0)
            if ZERO:
                tile = (code.to(tl.float32) - tl.load(zero_ptr + s_off, mask=mask, other=0.0)) * scale
            else:
                tile = (code - 8).to(tl.float32) * scale
        else:
            raw = tl.load(w_ptr + blk * (32 * Kp) + ((kk // 2) * 32 + r) * 2 + kk % 2, mask=mask, other=0)
            tile = raw.to(tl.float32) * tl.load(scale_ptr + blk * 32 + r, mask=nn < N, other=0.0)  # [block][32]
    return tile


@triton.jit
def _gate_up_kernel(x_ptr, gate_ptr, up_ptr, gate_s, up_s, gate_z, up_z, block_expert_ptr, block_slots_ptr, h_ptr,
                    S, H, I, K, stride_x, stride_we, stride_wi, stride_h, Kp, group,
                    BLOCK_S: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr,
                    PRECISION: tl.constexpr, EXPERT_MAJOR: tl.constexpr, FORMAT: tl.constexpr, ZERO: tl.constexpr):
    """h[s, i-block] = silu(x[s // K] . gate[e, i]) * (x[s // K] . up[e, i]) for the program's slots s."""
    e, slots, sel = _program_slots(block_expert_ptr, block_slots_ptr, S, BLOCK_S, EXPERT_MAJOR)
    if tl.max(sel.to(tl.int32), axis=0) > 0:
        rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)  # [BLOCK_I] intermediate rows
        tok = slots // K
        acc_g = tl.zeros((BLOCK_S, BLOCK_I), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_S, BLOCK_I), dtype=tl.float32)
        e64 = e.to(tl.int64)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            xs = tl.load(x_ptr + tok[:, None] * stride_x + cols[None, :],
                         mask=sel[:, None] & (cols[None, :] < H), other=0.0)  # [BLOCK_S, BLOCK_H]
            wg = _weight_tile(gate_ptr, gate_s, gate_z, e64, rows, cols, I, H, stride_we, stride_wi, Kp, group,
                              FORMAT, ZERO).to(xs.dtype)  # [BLOCK_H, BLOCK_I]
            wu = _weight_tile(up_ptr, up_s, up_z, e64, rows, cols, I, H, stride_we, stride_wi, Kp, group,
                              FORMAT, ZERO).to(xs.dtype)
            acc_g = tl.dot(xs, wg, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(xs, wu, acc_u, input_precision=PRECISION)
        act = acc_g * tl.sigmoid(acc_g) * acc_u
        tl.store(h_ptr + slots[:, None] * stride_h + rows[None, :], act,
                 mask=sel[:, None] & (rows[None, :] < I))


@triton.jit
def _down_kernel(h_ptr, down_ptr, down_s, down_z, block_expert_ptr, block_slots_ptr, w_ptr, y_ptr, S, H, I,
                 stride_h, stride_de, stride_dh, stride_y, Kp, group,
                 BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr,
                 PRECISION: tl.constexpr, EXPERT_MAJOR: tl.constexpr, FORMAT: tl.constexpr, ZERO: tl.constexpr,
                 CDTYPE: tl.constexpr):
    """y[s, h-block] = w[s] * (down[e, h-block] . h[s]) for the program's slots s; h rounded to CDTYPE."""
    e, row, sel = _program_slots(block_expert_ptr, block_slots_ptr, S, BLOCK_S, EXPERT_MAJOR)
    if tl.max(sel.to(tl.int32), axis=0) > 0:
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H] hidden rows of down
        acc = tl.zeros((BLOCK_S, BLOCK_H), dtype=tl.float32)
        e64 = e.to(tl.int64)
        for i0 in range(0, I, BLOCK_I):
            inner = i0 + tl.arange(0, BLOCK_I)
            hs = tl.load(h_ptr + row[:, None] * stride_h + inner[None, :],
                         mask=sel[:, None] & (inner[None, :] < I), other=0.0)  # [BLOCK_S, BLOCK_I]
            wd = _weight_tile(down_ptr, down_s, down_z, e64, cols, inner, H, I, stride_de, stride_dh, Kp, group,
                              FORMAT, ZERO).to(CDTYPE)  # [BLOCK_I, BLOCK_H]
            acc = tl.dot(hs.to(CDTYPE), wd, acc, input_precision=PRECISION)
        scale = tl.load(w_ptr + row, mask=sel, other=0.0)  # [BLOCK_S]
        tl.store(y_ptr + row[:, None] * stride_y + cols[None, :], acc * scale[:, None],
                 mask=sel[:, None] & (cols[None, :] < H))


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _weight_args(w) -> tuple:
    """(weights, scale, zero, stride over experts, stride over rows, Kp, group, FORMAT, ZERO) of a dense
    [E, N, K] tensor or a PackedMatrix (experts/packed_gpu.py), for _weight_tile."""
    if isinstance(w, torch.Tensor):
        return w, w, w, w.stride(0), w.stride(1), 0, 1, 0, False
    zero = w.zero if w.zero is not None else w.scale  # (unread without zero points)
    codes = w.w.view(torch.int8) if w.format == "int8" else w.w  # int8 codes are signed
    return codes, w.scale, zero, 0, 0, w.Kp, w.group, {"int4": 4, "int8": 8}[w.format], w.zero is not None


def gate_up_launch(x, gate, up, block_expert, block_slots, h, K: int, NB: int, block: int, precision: str,
                   expert_major: bool) -> None:
    """_gate_up_kernel over NB blocks of slots: gate, up dense [E, I, H] or PackedMatrix; x [T, H] in the
    compute dtype; h [S, I] float32."""
    I, H = gate.shape[1], gate.shape[2]
    g, gs, gz, se, sn, Kp, group, fmt, zero = _weight_args(gate)
    u, us, uz = _weight_args(up)[:3]
    _gate_up_kernel[(NB, triton.cdiv(I, 16))](
        x, g, u, gs, us, gz, uz, block_expert, block_slots, h, h.shape[0], H, I, K, x.stride(0), se, sn,
        h.stride(0), Kp, group, BLOCK_S=block, BLOCK_I=16, BLOCK_H=128, PRECISION=precision,
        EXPERT_MAJOR=expert_major, FORMAT=fmt, ZERO=zero)


def down_launch(h, down, block_expert, block_slots, w, y, NB: int, block: int, precision: str, expert_major: bool,
                dtype: torch.dtype) -> None:
    """_down_kernel over NB blocks of slots: down dense [E, H, I] or PackedMatrix; h [S, I] float32 rounded
    to dtype (the compute dtype) for the products; w [S] slot weights; y [S, H] float32."""
    H, I = down.shape[1], down.shape[2]
    d, ds, dz, se, sn, Kp, group, fmt, zero = _weight_args(down)
    _down_kernel[(NB, triton.cdiv(H, 32))](
        h, d, ds, dz, block_expert, block_slots, w, y, h.shape[0], H, I, h.stride(0), se, sn, y.stride(0), Kp, group,
        BLOCK_S=block, BLOCK_H=32, BLOCK_I=64, PRECISION=precision, EXPERT_MAJOR=expert_major, FORMAT=fmt,
        ZERO=zero, CDTYPE=_TL_DTYPES[dtype])


def triton_silu_experts(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                        ids: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum over slots with mask of weights * silu-gated expert_ids(x); float32 [T, H].

    x [T, H]; gate, up [E, I, H]; down [E, H, I] (contiguous, the model's dtype; or each a PackedMatrix of
    experts/packed_gpu.py, whose dtype is the compute dtype); ids [T, K] local
    to these E (anything where mask is False); weights [T, K]; mask [T, K] bool.
    """
    T, K = ids.shape
    E, I, H = gate.shape
    S = T * K
    expert_major = S <= MAX_EXPERT_MAJOR_SLOTS
    if expert_major:
        block = max(16, triton.next_power_of_2(S))  # tl.dot needs 16 rows
        block_slots = torch.where(mask, ids, -1).to(torch.int32).reshape(S)  # [S] each slot's expert
        block_expert, NB = block_slots, E  # (unread)
    else:
        block = block_size(S, E)
        block_expert, block_slots = slot_blocks(torch.where(mask, ids.long(), E).reshape(S), E, block)
        NB = block_expert.numel()
    w = weights.float().contiguous().reshape(S)  # the kernel reads w[s] at s: a strided view would be misread
    xw = x.to(gate.dtype).contiguous()
    h = torch.empty(S, I, dtype=torch.float32, device=x.device)  # rows of slots not here stay unread
    y = torch.zeros(S, H, dtype=torch.float32, device=x.device)  # slots not here add 0
    # fp32 models keep fp32 products (tf32 would miss the reference by ~1e-3)
    precision = "ieee" if gate.dtype == torch.float32 else "tf32"
    gate_up_launch(xw, gate, up, block_expert, block_slots, h, K, NB, block, precision, expert_major)
    down_launch(h, down, block_expert, block_slots, w, y, NB, block, precision, expert_major, gate.dtype)
    return y.view(T, K, H).sum(dim=1)
