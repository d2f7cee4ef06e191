"""The GPU share of a MoE layer as two Triton kernels that read only the routed experts' weights.

Three ways to hand programs their slots, all in shapes fixed by T, K and E with nothing waiting on
the host (a CUDA graph captures each):
- slot-major GEMV (S <= MAX_GEMV_SLOTS with packed weights, decode): gpu_experts_gemv_triton.py, a
  program per slot and block of rows, elementwise products without tl.dot.
- expert-major (S <= MAX_EXPERT_MAJOR_SLOTS, decode): program e reads the S slots' expert ids and
  works on those that are e; an expert no slot routes to returns after reading S ids. Each routed
  expert's weights are read exactly once, and the only other work is a few tiny torch ops.
- sorted blocks (longer steps, prefill): the slots are sorted by expert and cut into blocks of
  BLOCK_S slots of one expert each (slot_blocks in gpu_experts.py), so an expert's weights are read
  once per BLOCK_S of its slots; building the blocks takes a few dozen tiny torch ops, which a
  long step does not notice.

The weights are dense [E, N, K] tensors in the model's dtype, or PackedMatrix (experts/packed_gpu.py:
int4 / int8 codes and scales, as the CPU engine packs them), dequantized in registers: int8 tile by tile,
int4 group by group, each group's products on its integer codes scaled once per row afterwards. At one
token tl.dot pads the slot to 16 rows and int4 runs four small dots per group, so the expert-major kernels
take 92.7 us on Qwen3-30B-A3B's 5 int4 experts against 45.9 in bf16 and 26.8 in the GEMV kernels (H200).

The activation is SiLU or gpt-oss's clamped SwiGLU (gpu_experts_gemv_triton.glu); with biases (gpt-oss), gate's
and up's are added to their float32 sums before it, down's to its sum before the slot's routing weight.

T tokens, K slots per token, S = T * K slots (slot s is token s // K), E experts here,
H hidden, I expert intermediate size, NB blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hybridmoe.experts.gpu_experts import Biases, block_size, kernel_glu, slot_blocks
from hybridmoe.experts.gpu_experts_gemv_triton import gemv_launch, glu
from hybridmoe.experts.packed_gpu import kernel_weight_args

MAX_EXPERT_MAJOR_SLOTS = 64
"""Steps of at most this many slots (a batch of 8 with 8 experts per token) run expert-major: one
block of slots that every expert's programs scan."""
MAX_GEMV_SLOTS = 32
"""Steps of at most this many slots (4 tokens of 8 experts) with packed weights run the slot-major GEMV
kernels of gpu_experts_gemv_triton.py, faster than the expert-major kernels up to there (Qwen3-30B-A3B
int4 at T = 4: 129.2 against 212.5 us, H200)."""
GEMV_SPLIT_K = {1: (2, 1)}
"""Splits of K (gate/up, down) in the GEMV kernels by T (others: (1, 1)). At T = 1 gate/up split in 2 fills a
GPU that one expert's rows leave idle (DeepSeek-V3 int4: 41.6 against 56.8 us, H200); at T = 4 it is slower,
and splits of 4 and 8 and of down are slower at every T."""


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
def _weight_tile(w_ptr, scale_ptr, e, rows, cols, N, K, stride_we, stride_wn, INT8: tl.constexpr):
    """Weights (row n, column k) of expert e for n in rows, k in cols, as a [len(cols), len(rows)] tile: of a
    dense [E, N, K] tensor as they are, or int8 codes (PackedMatrix) times their rows' scales in float32."""
    kk = cols[:, None]  # [BK, 1]
    nn = rows[None, :]  # [1, BN]
    raw = tl.load(w_ptr + e * stride_we + nn * stride_wn + kk, mask=(kk < K) & (nn < N), other=0)
    if INT8:  # (constexpr branches: triton compiles only the one taken)
        tile = raw.to(tl.float32) * tl.load(scale_ptr + e * N + nn, mask=nn < N, other=0.0)
    else:
        tile = raw
    return tile


@triton.jit
def _int4_group(acc, x_lo, x_hi, codes_ptr, scale_ptr, zero_ptr, e, rows, g0, N, K, GROUP: tl.constexpr,
                ZERO: tl.constexpr, PRECISION: tl.constexpr):
    """acc [BS, BN] + the products of one int4 group of columns (g0 .. g0 + GROUP) with `rows` of expert e of an
    int4 PackedMatrix. x_lo, x_hi [BS, GROUP / 2]: the group's first and second half of columns, in the compute
    dtype (byte p of a group holds its columns p and GROUP / 2 + p).

    The codes go into the products as they are (small integers, exact in bf16 / fp16) and each row's sum is
    scaled once per group: scale x (codes . x - zero x sum(x)), zero 8 without zero points: the CPU engine's
    (code - zero) x scale, without rounding each weight to the compute dtype first. A group past K adds 0."""
    b = tl.arange(0, GROUP // 2)[:, None]  # [GROUP / 2, 1] bytes
    nn = rows[None, :]  # [1, BN]
    row = e * N + nn
    inside = (nn < N) & (nn * 0 + g0 < K)  # [1, BN] (a tensor, as the interpreter needs)
    raw = tl.load(codes_ptr + row * (K // 2) + g0 // 2 + b, mask=inside & (b >= 0), other=0).to(tl.int32)
    if ZERO:  # (constexpr branches: triton compiles only the one taken)
        lo = (raw & 0xF).to(x_lo.dtype)
        hi = (raw >> 4).to(x_lo.dtype)
    else:
        lo = ((raw & 0xF) - 8).to(x_lo.dtype)
        hi = ((raw >> 4) - 8).to(x_lo.dtype)
    part = tl.dot(x_lo, lo, input_precision=PRECISION)
    part = tl.dot(x_hi, hi, part, input_precision=PRECISION)  # [BS, BN] float32
    s_off = row * (K // GROUP) + g0 // GROUP  # [1, BN] scales [E, N, K / GROUP]
    if ZERO:
        xsum = tl.sum(x_lo.to(tl.float32), axis=1) + tl.sum(x_hi.to(tl.float32), axis=1)  # [BS]
        part = part - tl.load(zero_ptr + s_off, mask=inside, other=0.0) * xsum[:, None]
    return acc + part * tl.load(scale_ptr + s_off, mask=inside, other=0.0)


@triton.jit
def _bias_row(b_ptr, e, cols, N):
    """[1, len(cols)] float32: expert e's bias b [E, N] at cols."""
    return tl.load(b_ptr + e * N + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _gate_up_kernel(x_ptr, gate_ptr, up_ptr, gate_s, up_s, gate_z, up_z, gate_b, up_b, block_expert_ptr,
                    block_slots_ptr, h_ptr, S, H, I, K, stride_x, stride_we, stride_wi, stride_h, alpha, limit,
                    BLOCK_S: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr,
                    PRECISION: tl.constexpr, EXPERT_MAJOR: tl.constexpr, FORMAT: tl.constexpr, ZERO: tl.constexpr,
                    GROUP: tl.constexpr, GLU: tl.constexpr, HAS_BIAS: tl.constexpr):
    """h[s, i-block] = glu(x[s // K] . gate[e, i] + gate_b[e, i], x[s // K] . up[e, i] + up_b[e, i]) for the
    program's slots s (GLU, alpha, limit: gpu_experts_gemv_triton.glu's; the biases with HAS_BIAS).

    FORMAT 0: gate, up dense [E, I, H]; 8 / 4: int8 / int4 PackedMatrix codes (scales gate_s, up_s; zero
    points gate_z, up_z with ZERO), GROUP int4's group size (BLOCK_H a multiple of it)."""
    e, slots, sel = _program_slots(block_expert_ptr, block_slots_ptr, S, BLOCK_S, EXPERT_MAJOR)
    if tl.max(sel.to(tl.int32), axis=0) > 0:
        rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)  # [BLOCK_I] intermediate rows
        tok = slots // K
        acc_g = tl.zeros((BLOCK_S, BLOCK_I), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_S, BLOCK_I), dtype=tl.float32)
        e64 = e.to(tl.int64)
        x_row = x_ptr + tok[:, None] * stride_x
        for h0 in range(0, H, BLOCK_H):
            if FORMAT == 4:  # group by group: each group's half-columns, then its scales
                for gi in tl.static_range(BLOCK_H // GROUP):
                    c_lo = h0 + gi * GROUP + tl.arange(0, GROUP // 2)
                    x_lo = tl.load(x_row + c_lo[None, :], mask=sel[:, None] & (c_lo[None, :] < H), other=0.0)
                    x_hi = tl.load(x_row + GROUP // 2 + c_lo[None, :], mask=sel[:, None] & (c_lo[None, :] < H),
                                   other=0.0)
                    acc_g = _int4_group(acc_g, x_lo, x_hi, gate_ptr, gate_s, gate_z, e64, rows, h0 + gi * GROUP, I, H,
                                        GROUP, ZERO, PRECISION)
                    acc_u = _int4_group(acc_u, x_lo, x_hi, up_ptr, up_s, up_z, e64, rows, h0 + gi * GROUP, I, H,
                                        GROUP, ZERO, PRECISION)
            else:
                cols = h0 + tl.arange(0, BLOCK_H)
                xs = tl.load(x_row + cols[None, :], mask=sel[:, None] & (cols[None, :] < H), other=0.0)
                wg = _weight_tile(gate_ptr, gate_s, e64, rows, cols, I, H, stride_we, stride_wi,
                                  FORMAT == 8).to(xs.dtype)  # [BLOCK_H, BLOCK_I]
                wu = _weight_tile(up_ptr, up_s, e64, rows, cols, I, H, stride_we, stride_wi, FORMAT == 8).to(xs.dtype)
                acc_g = tl.dot(xs, wg, acc_g, input_precision=PRECISION)
                acc_u = tl.dot(xs, wu, acc_u, input_precision=PRECISION)
        if HAS_BIAS:
            acc_g += _bias_row(gate_b, e64, rows, I)
            acc_u += _bias_row(up_b, e64, rows, I)
        out = h_ptr + slots[:, None] * stride_h + rows[None, :]
        tl.store(out, glu(acc_g, acc_u, GLU, alpha, limit), mask=sel[:, None] & (rows[None, :] < I))


@triton.jit
def _down_kernel(h_ptr, down_ptr, down_s, down_z, down_b, block_expert_ptr, block_slots_ptr, w_ptr, y_ptr, S, H, I,
                 stride_h, stride_de, stride_dh, stride_y,
                 BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr,
                 PRECISION: tl.constexpr, EXPERT_MAJOR: tl.constexpr, FORMAT: tl.constexpr, ZERO: tl.constexpr,
                 GROUP: tl.constexpr, CDTYPE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y[s, h-block] = w[s] * (down[e, h-block] . h[s] + down_b[e, h-block]) for the program's slots s (the bias
    with HAS_BIAS); h rounded to CDTYPE. FORMAT, ZERO, GROUP as _gate_up_kernel's (BLOCK_I a multiple of GROUP
    for int4)."""
    e, row, sel = _program_slots(block_expert_ptr, block_slots_ptr, S, BLOCK_S, EXPERT_MAJOR)
    if tl.max(sel.to(tl.int32), axis=0) > 0:
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H] hidden rows of down
        acc = tl.zeros((BLOCK_S, BLOCK_H), dtype=tl.float32)
        e64 = e.to(tl.int64)
        h_row = h_ptr + row[:, None] * stride_h
        for i0 in range(0, I, BLOCK_I):
            if FORMAT == 4:
                for gi in tl.static_range(BLOCK_I // GROUP):
                    c_lo = i0 + gi * GROUP + tl.arange(0, GROUP // 2)
                    inside = sel[:, None] & (c_lo[None, :] < I)
                    h_lo = tl.load(h_row + c_lo[None, :], mask=inside, other=0.0)
                    h_hi = tl.load(h_row + GROUP // 2 + c_lo[None, :], mask=inside, other=0.0)
                    acc = _int4_group(acc, h_lo.to(CDTYPE), h_hi.to(CDTYPE), down_ptr, down_s, down_z, e64, cols,
                                      i0 + gi * GROUP, H, I, GROUP, ZERO, PRECISION)
            else:
                inner = i0 + tl.arange(0, BLOCK_I)
                hs = tl.load(h_row + inner[None, :], mask=sel[:, None] & (inner[None, :] < I), other=0.0)
                wd = _weight_tile(down_ptr, down_s, e64, cols, inner, H, I, stride_de, stride_dh,
                                  FORMAT == 8).to(CDTYPE)  # [BLOCK_I, BLOCK_H]
                acc = tl.dot(hs.to(CDTYPE), wd, acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += _bias_row(down_b, e64, cols, H)
        scale = tl.load(w_ptr + row, mask=sel, other=0.0)  # [BLOCK_S]
        out = y_ptr + row[:, None] * stride_y + cols[None, :]
        tl.store(out, acc * scale[:, None], mask=sel[:, None] & (cols[None, :] < H))


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
INT4_GATE_UP_BLOCK_K, INT4_DOWN_BLOCK_K = 128, 128
"""Columns a program's step covers in int4 (multiples of every group size, 32 / 64 / 128). 512 / 256 (as many
bytes a step as bf16's 128 columns) are no faster at one token and slower at more (62 routed experts: 652.9
against 532.6 us, H200)."""


def gate_up_launch(x, gate, up, block_expert, block_slots, h, K: int, NB: int, block: int, precision: str,
                   expert_major: bool, act=F.silu, biases: Biases | None = None) -> None:
    """_gate_up_kernel over NB blocks of slots: gate, up dense [E, I, H] or PackedMatrix; x [T, H] in the
    compute dtype; h [S, I] float32; act: F.silu or a ClampedSwiGLU; biases (gate's and up's read) or None."""
    I, H = gate.shape[1], gate.shape[2]
    g, gs, gz, se, sn, fmt, zero, group = kernel_weight_args(gate)
    u, us, uz = kernel_weight_args(up)[:3]
    kind, alpha, limit = kernel_glu(act)
    gb, ub = (_contiguous(b) for b in biases[:2]) if biases is not None else (x, x)  # (unread without biases)
    _gate_up_kernel[(NB, triton.cdiv(I, 16))](
        x, g, u, gs, us, gz, uz, gb, ub, block_expert, block_slots, h, h.shape[0], H, I, K, x.stride(0), se, sn,
        h.stride(0), alpha, limit, BLOCK_S=block, BLOCK_I=16, BLOCK_H=INT4_GATE_UP_BLOCK_K if fmt == 4 else 128,
        PRECISION=precision, EXPERT_MAJOR=expert_major, FORMAT=fmt, ZERO=zero, GROUP=group, GLU=kind,
        HAS_BIAS=biases is not None)


def down_launch(h, down, block_expert, block_slots, w, y, NB: int, block: int, precision: str, expert_major: bool,
                dtype: torch.dtype, biases: Biases | None = None) -> None:
    """_down_kernel over NB blocks of slots: down dense [E, H, I] or PackedMatrix; h [S, I] as gate_up_launch
    wrote it, rounded to dtype (the compute dtype) for the products; w [S] slot weights; y [S, H] float32;
    biases (down's read) or None."""
    H, I = down.shape[1], down.shape[2]
    d, ds, dz, se, sn, fmt, zero, group = kernel_weight_args(down)
    db = _contiguous(biases[2]) if biases is not None else h  # (unread without biases)
    _down_kernel[(NB, triton.cdiv(H, 32))](
        h, d, ds, dz, db, block_expert, block_slots, w, y, h.shape[0], H, I, h.stride(0), se, sn, y.stride(0),
        BLOCK_S=block, BLOCK_H=32, BLOCK_I=INT4_DOWN_BLOCK_K if fmt == 4 else 64, PRECISION=precision,
        EXPERT_MAJOR=expert_major, FORMAT=fmt, ZERO=zero, GROUP=group, CDTYPE=_TL_DTYPES[dtype],
        HAS_BIAS=biases is not None)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    """t as the kernels read a bias: rows laid out one after another."""
    return t if t.is_contiguous() else t.contiguous()


def triton_experts(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                   ids: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor, act=F.silu,
                   biases: Biases | None = None, gemv: bool | None = None,
                   split_k: tuple[int, int] | None = None) -> torch.Tensor:
    """sum over slots with mask of weights * expert_ids(x); float32 [T, H]. act: F.silu or a ClampedSwiGLU
    (layers/clamped_swiglu.py); biases: (gate [E, I], up [E, I], down [E, H]) of these experts, or None.

    gemv: run the slot-major GEMV kernels of gpu_experts_gemv_triton.py, with K split split_k ways (None:
    GEMV_SPLIT_K's for T); None: when S <= MAX_GEMV_SLOTS and the weights are packed. Otherwise the tl.dot
    kernels: expert-major up to MAX_EXPERT_MAJOR_SLOTS slots, sorted blocks past that.

    x [T, H]; gate, up [E, I, H]; down [E, H, I] (contiguous, the model's dtype; or each a PackedMatrix of
    experts/packed_gpu.py, whose dtype is the compute dtype); ids [T, K] local
    to these E (anything where mask is False); weights [T, K]; mask [T, K] bool.
    """
    T, K = ids.shape
    E, I, H = gate.shape
    S = T * K
    if gemv is None:
        gemv = S <= MAX_GEMV_SLOTS and not isinstance(gate, torch.Tensor)
    xw = x.to(gate.dtype).contiguous()
    if gemv:
        gu, dn = split_k or GEMV_SPLIT_K.get(T, (1, 1))
        h = torch.empty((S, I) if gu == 1 else (gu, S, 2 * I), dtype=torch.float32, device=x.device)
        y = torch.empty((S, H) if dn == 1 else (dn, S, H), dtype=torch.float32, device=x.device)
        gemv_launch(xw, gate, up, down, ids, mask, weights, h, y, K, _TL_DTYPES[gate.dtype], (gu, dn),
                    kernel_glu(act), None if biases is None else tuple(_contiguous(b) for b in biases))
        if dn > 1:
            y = y.sum(dim=0)  # the splits' parts, in a fixed order
        return y.view(T, K, H).sum(dim=1)
    if S <= MAX_EXPERT_MAJOR_SLOTS:
        block = max(16, triton.next_power_of_2(S))  # tl.dot needs 16 rows
        block_slots = torch.where(mask, ids, -1).to(torch.int32).reshape(S)  # [S] each slot's expert
        block_expert, NB = block_slots, E  # (unread)
    else:
        block = block_size(S, E)
        block_expert, block_slots = slot_blocks(torch.where(mask, ids.long(), E).reshape(S), E, block)
        NB = block_expert.numel()
    w = weights.float().contiguous().reshape(S)  # the kernel reads w[s] at s: a strided view would be misread
    h = torch.empty((S, I), dtype=torch.float32, device=x.device)  # rows of slots not here stay unread
    y = torch.zeros((S, H), dtype=torch.float32, device=x.device)  # and add 0
    # fp32 models keep fp32 products (tf32 would miss the reference by ~1e-3)
    precision = "ieee" if gate.dtype == torch.float32 else "tf32"
    expert_major = S <= MAX_EXPERT_MAJOR_SLOTS
    gate_up_launch(xw, gate, up, block_expert, block_slots, h, K, NB, block, precision, expert_major, act, biases)
    down_launch(h, down, block_expert, block_slots, w, y, NB, block, precision, expert_major, gate.dtype, biases)
    return y.view(T, K, H).sum(dim=1)
