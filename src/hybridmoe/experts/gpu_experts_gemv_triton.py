"""The GPU share of a decode step of few tokens as two slot-major Triton GEMV kernels.

Program (s, n-block, split) works on slot s alone: it reads the BLOCK_N rows of slot s's expert (its
split's share of the columns) and multiplies them with that one token's vector, as elementwise
products summed along the columns, without tl.dot. tl.dot needs 16 rows of slots, so the
expert-major kernels of gpu_experts_triton.py pad one token's slot to 16 and, for int4, run four
small dots per group; at one token a matrix-vector product is all there is to do. A slot not on the
GPU returns at once (the down kernel stores its zeros). Two slots of one expert read its rows twice, the
second time mostly from L2, so this form is for steps of few slots (gpu_experts_triton.MAX_GEMV_SLOTS).
The kernels read ids, mask and weights as the router left them: no torch op runs before them.

Products are exact in float32 (codes, and x or h rounded to the compute dtype, as the expert-major
kernels round them) and summed in float32: the same numbers those kernels' dots multiply, summed in
another order. The activation is SiLU or gpt-oss's clamped SwiGLU (GLU, glu below); with biases, gate's
and up's are added to their sums before it and down's to its sum before the routing weight, each in
float32 and once (by the first split where K is split).

S slots (slot s is token s // K), E experts here, H hidden, I expert intermediate size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridmoe.experts.packed_gpu import kernel_weight_args

GEMV_BLOCK_N, GEMV_WARPS = 8, 4
"""Rows and warps of a program."""
GEMV_BLOCK_K = {0: 128, 8: 512, 4: 512}
"""Columns per step by FORMAT (dense, int8, int4); int4's are a multiple of every group size (32 / 64 / 128).

8 rows x 512 columns x 4 warps is the fastest of rows 8 / 16 / 32, columns 256 / 512 and warps 2 / 4 / 8 for
every int4 and int8 shape at T = 1 and 4 (Qwen3-30B-A3B int4, T = 1: 26.8 against 40.4 us at 16 x 256 x 4, H200).
The dense path (gemv=True on bf16 weights) is not the default: slower than the dot kernels (46.3 against 39.6 us)."""


@triton.jit
def glu(g, u, GLU: tl.constexpr, alpha, limit):
    """h from an expert's gate and up sums g, u (float32, biases added): GLU 0, silu(g) x u; 1, gpt-oss's clamped
    SwiGLU (layers/clamped_swiglu.py): g clamped to at most limit, u to [-limit, limit], (u + 1) x g x
    sigmoid(alpha x g)."""
    if GLU == 1:  # (constexpr branches: triton compiles only the one taken)
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        h = (u + 1.0) * (g * tl.sigmoid(alpha * g))
    else:
        h = g * tl.sigmoid(g) * u
    return h


@triton.jit
def _vector(v_ptr, cols, mask, half, stride_split, V_SPLIT: tl.constexpr, CDTYPE: tl.constexpr, GLU: tl.constexpr,
            alpha, limit):
    """The vector at cols (any shape) in float32: V_SPLIT 0, x as stored (the compute dtype); 1, h as
    _gemv_gate_up_kernel stored it (float32), rounded to CDTYPE; > 1, glu(sum of the splits' gate sums, sum of
    their up sums, half further), added in split order, rounded to CDTYPE."""
    if V_SPLIT == 0:  # (constexpr branches: triton compiles only the one taken)
        v = tl.load(v_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    elif V_SPLIT == 1:
        v = tl.load(v_ptr + cols, mask=mask, other=0.0).to(CDTYPE).to(tl.float32)
    else:
        g = tl.zeros(cols.shape, dtype=tl.float32)
        u = tl.zeros(cols.shape, dtype=tl.float32)
        for k in tl.static_range(V_SPLIT):
            g += tl.load(v_ptr + k * stride_split + cols, mask=mask, other=0.0)
            u += tl.load(v_ptr + k * stride_split + half + cols, mask=mask, other=0.0)
        v = glu(g, u, GLU, alpha, limit).to(CDTYPE).to(tl.float32)
    return v


@triton.jit
def _row_products(v_ptr, w_ptr, scale_ptr, zero_ptr, e, rows, k0, N, K, stride_we, stride_wn, half, stride_split,
                  alpha, limit, BLOCK_K: tl.constexpr, FORMAT: tl.constexpr, ZERO: tl.constexpr, GROUP: tl.constexpr,
                  V_SPLIT: tl.constexpr, CDTYPE: tl.constexpr, GLU: tl.constexpr):
    """[BLOCK_N] float32: for each n in rows, the sum over columns k0 .. k0 + BLOCK_K of expert e's weight
    (n, k) times the vector's k (_vector with V_SPLIT, GLU, alpha, limit). FORMAT 0 dense [E, N, K]; 8 int8 codes
    x their rows' scales; 4 int4 codes group by group (byte p of a group holds its columns p and GROUP / 2 + p),
    each group's sum scaled once: scale x (codes . v - zero x sum(v)), zero 8 without zero points."""
    if FORMAT == 4:
        HALF: tl.constexpr = GROUP // 2
        r = rows[:, None, None]  # [BN, 1, 1]
        g = tl.arange(0, BLOCK_K // GROUP)[None, :, None]  # [1, NG, 1] groups of the step
        p = tl.arange(0, HALF)[None, None, :]  # [1, 1, HALF] bytes of a group
        col = k0 + g * GROUP + p  # [1, NG, HALF] the low nibbles' columns
        inside = col < K
        raw = tl.load(w_ptr + (e * N + r) * (K // 2) + k0 // 2 + g * HALF + p, mask=(r < N) & inside,
                      other=0).to(tl.int32)
        lo = (raw & 0xF).to(tl.float32)
        hi = (raw >> 4).to(tl.float32)
        v_lo = _vector(v_ptr, col, inside, half, stride_split, V_SPLIT, CDTYPE, GLU, alpha, limit)
        v_hi = _vector(v_ptr, col + HALF, inside, half, stride_split, V_SPLIT, CDTYPE, GLU, alpha, limit)
        part = tl.sum(lo * v_lo + hi * v_hi, axis=2)  # [BN, NG]
        gs = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)[None, :]  # [1, NG]
        s_off = (e * N + rows[:, None]) * (K // GROUP) + gs
        s_mask = (rows[:, None] < N) & (gs * GROUP < K)
        vsum = tl.sum(v_lo + v_hi, axis=2)  # [1, NG]
        if ZERO:
            part = part - tl.load(zero_ptr + s_off, mask=s_mask, other=0.0) * vsum
        else:
            part = part - 8.0 * vsum
        out = tl.sum(part * tl.load(scale_ptr + s_off, mask=s_mask, other=0.0), axis=1)
    else:
        cols = k0 + tl.arange(0, BLOCK_K)[None, :]  # [1, BK]
        nn = rows[:, None]  # [BN, 1]
        w = tl.load(w_ptr + e * stride_we + nn * stride_wn + cols, mask=(nn < N) & (cols < K), other=0)
        v = _vector(v_ptr, cols, cols < K, half, stride_split, V_SPLIT, CDTYPE, GLU, alpha, limit)
        out = tl.sum(w.to(tl.float32) * v, axis=1)
        if FORMAT == 8:
            out = out * tl.load(scale_ptr + e * N + rows, mask=rows < N, other=0.0)
    return out


@triton.jit
def _slot_expert(ids_ptr, mask_ptr):
    """The expert of this program's slot (program_id 0) as int64; -1 where the mask says the slot is not here."""
    s = tl.program_id(0)
    return tl.where(tl.load(mask_ptr + s) != 0, tl.load(ids_ptr + s).to(tl.int64), -1)


@triton.jit
def _split_columns(K, chunk, SPLIT: tl.constexpr):
    """This program's columns k_start .. k_end of K: all of them, or with SPLIT > 1 its split's chunk (split k =
    program_id 2)."""
    if SPLIT == 1:
        k_start, k_end = 0, K
    else:
        k_start = tl.program_id(2) * chunk
        k_end = tl.minimum(K, k_start + chunk)
    return k_start, k_end


@triton.jit
def _first_split_bias(b_ptr, e, rows, N, HAS_BIAS: tl.constexpr):
    """[len(rows)] float32: expert e's bias b [E, N] at rows for the program of split 0 (program_id 2), zeros
    for the others (their sums are added to split 0's) and without biases."""
    out = tl.zeros(rows.shape, dtype=tl.float32)
    if HAS_BIAS:
        first = (rows * 0 + tl.program_id(2)) == 0
        out = tl.load(b_ptr + e * N + rows, mask=(rows < N) & first, other=0.0).to(tl.float32)
    return out


@triton.jit
def _gemv_gate_up_kernel(x_ptr, gate_ptr, up_ptr, gate_s, up_s, gate_z, up_z, gate_b, up_b, ids_ptr, mask_ptr, h_ptr,
                         H, I, K, stride_x, stride_we, stride_wi, stride_h, chunk, stride_split, alpha, limit,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FORMAT: tl.constexpr, ZERO: tl.constexpr,
                         GROUP: tl.constexpr, SPLIT: tl.constexpr, CDTYPE: tl.constexpr, GLU: tl.constexpr,
                         HAS_BIAS: tl.constexpr):
    """h[s, n-block] = glu(x[s // K] . gate[e, n] + gate_b[e, n], x[s // K] . up[e, n] + up_b[e, n]), e slot s's
    expert (biases with HAS_BIAS); with SPLIT > 1 program (., ., k) sums columns k * chunk .. (k + 1) * chunk only
    and stores gate's and up's sums (split 0's with the biases) as h[k, s, :I] and h[k, s, I:] (stride_split apart);
    _gemv_down_kernel adds them in split order and applies the activation."""
    s = tl.program_id(0)
    e = _slot_expert(ids_ptr, mask_ptr)
    if e >= 0:  # (h's rows of other slots stay unread)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        x_row = x_ptr + (s // K) * stride_x
        k_start, k_end = _split_columns(H, chunk, SPLIT)
        acc_g = _first_split_bias(gate_b, e, rows, I, HAS_BIAS)
        acc_u = _first_split_bias(up_b, e, rows, I, HAS_BIAS)
        for k0 in range(k_start, k_end, BLOCK_K):
            acc_g += _row_products(x_row, gate_ptr, gate_s, gate_z, e, rows, k0, I, H, stride_we, stride_wi, 0, 0,
                                   alpha, limit, BLOCK_K, FORMAT, ZERO, GROUP, 0, CDTYPE, GLU)
            acc_u += _row_products(x_row, up_ptr, up_s, up_z, e, rows, k0, I, H, stride_we, stride_wi, 0, 0,
                                   alpha, limit, BLOCK_K, FORMAT, ZERO, GROUP, 0, CDTYPE, GLU)
        out = h_ptr + s * stride_h + rows
        if SPLIT == 1:
            tl.store(out, glu(acc_g, acc_u, GLU, alpha, limit), mask=rows < I)
        else:
            out += tl.program_id(2) * stride_split
            tl.store(out, acc_g, mask=rows < I)
            tl.store(out + I, acc_u, mask=rows < I)


@triton.jit
def _gemv_down_kernel(h_ptr, down_ptr, down_s, down_z, down_b, ids_ptr, mask_ptr, w_ptr, y_ptr, H, I,
                      stride_h, stride_de, stride_dh, stride_y, h_split, chunk, y_split, alpha, limit,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FORMAT: tl.constexpr, ZERO: tl.constexpr,
                      GROUP: tl.constexpr, CDTYPE: tl.constexpr, H_SPLIT: tl.constexpr, SPLIT: tl.constexpr,
                      GLU: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y[s, n-block] = w[s] * (down[e, n] . h[s] + down_b[e, n]), h as _gemv_gate_up_kernel stored it with
    H_SPLIT splits (h_split apart; activated here with GLU, alpha, limit) rounded to CDTYPE, the bias with HAS_BIAS;
    SPLIT > 1: program (., ., k) sums columns k * chunk .. (k + 1) * chunk of I only (split 0 adds the bias), into
    y + k * y_split. A slot not here stores zeros (y needs no clearing first)."""
    s = tl.program_id(0)
    e = _slot_expert(ids_ptr, mask_ptr)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    out = y_ptr + s * stride_y + rows
    if SPLIT > 1:
        out += tl.program_id(2) * y_split
    if e < 0:
        tl.store(out, tl.zeros((BLOCK_N,), dtype=tl.float32), mask=rows < H)
    else:
        k_start, k_end = _split_columns(I, chunk, SPLIT)
        acc = _first_split_bias(down_b, e, rows, H, HAS_BIAS)
        for k0 in range(k_start, k_end, BLOCK_K):
            acc += _row_products(h_ptr + s * stride_h, down_ptr, down_s, down_z, e, rows, k0, H, I, stride_de,
                                 stride_dh, I, h_split, alpha, limit, BLOCK_K, FORMAT, ZERO, GROUP, H_SPLIT, CDTYPE,
                                 GLU)
        tl.store(out, acc * tl.load(w_ptr + s).to(tl.float32), mask=rows < H)


def gemv_launch(x, gate, up, down, ids, mask, weights, h, y, K: int, cdtype, split: tuple[int, int],
                glu_args: tuple[int, float, float] = (0, 0.0, 0.0), biases: tuple | None = None) -> None:
    """Both kernels over the S = T * K slots of ids [T, K] (any integer dtype), mask [T, K] bool, weights [T, K]
    (any float dtype), read as they are; h, y float32 laid out as gpu_experts_triton.triton_experts
    allocates them for `split` (gate/up, down), y not cleared; cdtype the compute dtype (triton's). glu_args:
    gpu_experts.kernel_glu's (GLU, alpha, limit); biases: (gate [E, I], up [E, I], down [E, H]) contiguous, any
    float dtype, or None."""
    ids, mask, weights = ids.contiguous(), mask.contiguous().view(torch.uint8), weights.contiguous()
    S = ids.numel()
    I, H = gate.shape[1], gate.shape[2]
    gu, dn = split
    act, alpha, limit = glu_args
    gb, ub, db = biases if biases is not None else (x, x, x)  # (unread without biases)
    g, gs, gz, se, sn, fmt, zero, group = kernel_weight_args(gate)
    u, us, uz = kernel_weight_args(up)[:3]
    step, rows, warps = GEMV_BLOCK_K[fmt], GEMV_BLOCK_N, GEMV_WARPS
    chunk = triton.cdiv(triton.cdiv(H, gu), step) * step  # whole steps (and int4 groups) per split
    _gemv_gate_up_kernel[(S, triton.cdiv(I, rows), gu)](
        x, g, u, gs, us, gz, uz, gb, ub, ids, mask, h, H, I, K, x.stride(0), se, sn, h.stride(-2), chunk,
        h.stride(0) if gu > 1 else 0, alpha, limit, BLOCK_N=rows, BLOCK_K=step, FORMAT=fmt, ZERO=zero, GROUP=group,
        SPLIT=gu, CDTYPE=cdtype, GLU=act, HAS_BIAS=biases is not None, num_warps=warps)
    d, ds, dz, se, sn = kernel_weight_args(down)[:5]
    chunk = triton.cdiv(triton.cdiv(I, dn), step) * step
    _gemv_down_kernel[(S, triton.cdiv(H, rows), dn)](
        h, d, ds, dz, db, ids, mask, weights, y, H, I, h.stride(-2), se, sn, y.stride(-2),
        h.stride(0) if gu > 1 else 0, chunk, y.stride(0) if dn > 1 else 0, alpha, limit, BLOCK_N=rows, BLOCK_K=step,
        FORMAT=fmt, ZERO=zero, GROUP=group, CDTYPE=cdtype, H_SPLIT=gu, SPLIT=dn, GLU=act,
        HAS_BIAS=biases is not None, num_warps=warps)
