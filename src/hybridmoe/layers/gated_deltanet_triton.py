"""The gated delta rule's decode step and chunked prefill (layers/gated_deltanet.py), each with the short causal
convolution before it, in Triton, over the per-slot states of linear_attention.DeltaNetState updated in place.

Both entry points take what the layer's convolution takes: mixed [T, Ch], the in-projections' q, k and v channels
(all Hk key heads of q, all of k, then all Hv value heads of v), with the layer's g (float32, <= 0) and beta [T, Hv].
Per sequence b (a decode row, or a prefill sequence of cu_seqlens) they compute what GatedDeltaNet's torch path does:
  - the convolution: a depthwise causal conv1d of kernel K over the new tokens continuing from conv_state[slots[b]]
    (the last K - 1 inputs before them, rewritten with the last K - 1 inputs after them), then SiLU; its output and
    the SiLU's are rounded to mixed's dtype, as torch's ops leave them;
  - the heads: q and k L2-normalized in float32 (gated_deltanet.l2_normalize), q scaled by Dk^-1/2; value head h
    reads key head h // (Hv / Hk), as the layer's repeat_interleave of q and k to the value heads gives it;
  - the rule from recurrent[slots[b]] (float32 [Hv, Dk, Dv]), which then holds the state after the new tokens;
    the output o [T, Hv, Dv] is float32, as the torch rule returns it.
has_state[b] False starts sequence b from zero states (a sequence at position 0) without reading its slot; None: every
sequence continues its slot. Sequences of one call name distinct slots: each program reads and rewrites its slot's
rows with no ordering against other rows'.

Decode (one token per row): the convolution kernel, then one program per (row, value head, BLOCK_V columns of the
state). Each column of S evolves on its own (S^T k and S^T q are per column), so a program keeps its [Dk, BLOCK_V]
tile in registers through the step. Nothing is read on the host and no shape depends on a value, so the step replays
inside a CUDA graph whose slots and has_state are device inputs. A padding row of a fixed-shape step computes like
any other on a spare slot of its own: its output and that slot's states are garbage that nothing reads.

Prefill: the convolution kernel over each sequence's tokens, then the chunked form of gated_deltanet.py's module
docstring, in chunks of CHUNK tokens from each sequence's first token (chunk_gated_delta_rule's), in two kernels:
  - per (chunk, value head), in parallel: the inverse of the chunk's unit lower-triangular L = I + A,
    A_ij = beta_i exp(G_i - G_j) (k_i . k_j) for j < i. It doubles blocks along the diagonal: with X the inverse of
    L's block diagonal in blocks of b (X = I for b = 1) and M the entries of L in blocks of 2b below those of b,
    X - X M X is the inverse of L's block diagonal in blocks of 2b (the 2 x 2 block lower-triangular inverse, which
    FLA's solve_tril uses to merge its 16 x 16 blocks), log2(CHUNK) levels of two matrix products. Every
    intermediate is a block of the inverse itself, so nothing grows as powers of A do for aligned keys.
  - per (sequence, value head, BLOCK_V state columns), chunk after chunk: u = L^-1 beta (v - exp(G) k S),
    o = exp(G) q S + ((q k^T) exp(G_i - G_j), j <= i) u, S <- exp(G_n) S + (k exp(G_n - G))^T u.
The prefill's grid depends on the sequences' lengths (cu_seqlens comes from the host), as an eager prefill step's
does.

T tokens, B rows or sequences, S slots, Hk key heads, Hv value heads, Dk, Dv their dims, Ch = 2 Hk Dk + Hv Dv, K the
convolution's kernel.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from hybridmoe.layers.gated_deltanet import DEFAULT_CHUNK

CHUNK = DEFAULT_CHUNK
"""Tokens per chunk of the prefill: chunk_gated_delta_rule's default, so both split a sequence alike."""

EPS = 1e-6
"""gated_deltanet.l2_normalize's eps (inside the root)."""

DECODE_BLOCK_V = 16
PREFILL_BLOCK_V = 32
"""State columns per program of the decode step and of the prefill's scan: Dv / BLOCK_V programs share a (row or
sequence, value head), each a [Dk, BLOCK_V] float32 tile of the state (the decode's smaller: more programs for a
small batch, and its tile with q and k fits the registers at Dk = 128)."""

DOT_PRECISION = "tf32x3"
"""The prefill's float32 matrix products on tensor cores: each operand split into its tf32 value and the tf32 of the
rest, three products summed, close to float32's accuracy (float32 "ieee" products of these tiles compile to code
that keeps them in local memory)."""
_PRECISION = tl.constexpr(DOT_PRECISION)


@triton.jit
def _conv_inputs(x_ptr, st_ptr, lo, n, p, c, cm, keep, stride_x, stride_sc, K: tl.constexpr):
    """The convolution's inputs at positions p [BLOCK_P] relative to a sequence's first new token, for channels c
    [BLOCK_C] (cm: those < Ch) -> [BLOCK_P, BLOCK_C] float32: row lo + p of x for 0 <= p < n (its n new tokens), column
    K - 1 + p of its conv state (st_ptr: its slot's row) for 1 - K <= p < 0 where keep, zeros elsewhere."""
    new = tl.load(x_ptr + (lo + p)[:, None].to(tl.int64) * stride_x + c[None, :],
                  mask=((p >= 0) & (p < n))[:, None] & cm[None, :], other=0.0)
    old = tl.load(st_ptr + c[None, :] * stride_sc + (K - 1 + p)[:, None],
                  mask=((p < 0) & (p >= 1 - K) & keep)[:, None] & cm[None, :], other=0.0)
    return new.to(tl.float32) + old.to(tl.float32)


@triton.jit
def _conv_kernel(x_ptr, w_ptr, st_ptr, out_ptr, slot_ptr, flag_ptr, cu_ptr, Ch, stride_x, stride_w, stride_ss,
                 stride_sc, stride_o, K: tl.constexpr, VARLEN: tl.constexpr, HAS_FLAGS: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (b, cb): channels cb * BLOCK_C .. of sequence b (VARLEN: rows cu[b] .. cu[b + 1] - 1 of x; else row
    b alone), BLOCK_T tokens at a time: out = silu(conv), each rounded to out's dtype; then its slot's conv state
    <- the last K - 1 inputs."""
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < Ch
    if VARLEN:
        lo = tl.load(cu_ptr + b)
        n = tl.load(cu_ptr + b + 1) - lo
    else:
        lo = b
        n = 1
    keep = True
    if HAS_FLAGS:
        keep = tl.load(flag_ptr + b) != 0
    st = st_ptr + tl.load(slot_ptr + b).to(tl.int64) * stride_ss
    j = tl.arange(0, BLOCK_K)
    kept = _conv_inputs(x_ptr, st, lo, n, n - (K - 1) + j, c, cm, keep, stride_x, stride_sc, K)
    for t0 in range(0, n, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for i in tl.static_range(K):
            w = tl.load(w_ptr + c * stride_w + i, mask=cm, other=0.0).to(tl.float32)
            acc += _conv_inputs(x_ptr, st, lo, n, t - (K - 1) + i, c, cm, keep, stride_x, stride_sc, K) * w[None, :]
        y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        y = (y * tl.sigmoid(y)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + (lo + t)[:, None].to(tl.int64) * stride_o + c[None, :], y,
                 mask=(t < n)[:, None] & cm[None, :])
    tl.debug_barrier()  # every read of the old state (any thread's) before the new one overwrites it
    tl.store(st + c[None, :] * stride_sc + j[:, None], kept.to(st_ptr.dtype.element_ty),
             mask=(j < K - 1)[:, None] & cm[None, :])


@triton.jit
def _l2_normalize(x, eps):
    """x / sqrt(sum(x^2) + eps) over the last dim (gated_deltanet.l2_normalize), float32."""
    return x * tl.math.rsqrt(tl.sum(x * x, axis=-1, keep_dims=True) + eps)


@triton.jit
def _decode_step_kernel(y_ptr, g_ptr, beta_ptr, rec_ptr, slot_ptr, flag_ptr, o_ptr, scale, eps, R, HK, DK, DV,
                        stride_y, stride_g, stride_beta, stride_rs, stride_rh, stride_rk, HAS_FLAGS: tl.constexpr,
                        BLOCK_DK: tl.constexpr, BLOCK_V: tl.constexpr):
    """Program (b, h, vb): value head h of row b, state columns vb * BLOCK_V .., one step of the rule from the
    activated convolution's output y [B, Ch] -> o [B, Hv, Dv]; the slot's state tile is rewritten."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    e = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    em = e < DV
    d = tl.arange(0, BLOCK_DK)
    dm = d < DK
    row = y_ptr + b.to(tl.int64) * stride_y
    kh = h // R
    q = _l2_normalize(tl.load(row + kh * DK + d, mask=dm, other=0.0).to(tl.float32), eps) * scale
    k = _l2_normalize(tl.load(row + (HK + kh) * DK + d, mask=dm, other=0.0).to(tl.float32), eps)
    v = tl.load(row + 2 * HK * DK + h * DV + e, mask=em, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b * stride_g + h).to(tl.float32)
    beta = tl.load(beta_ptr + b * stride_beta + h).to(tl.float32)
    keep = True
    if HAS_FLAGS:
        keep = tl.load(flag_ptr + b) != 0
    at = rec_ptr + tl.load(slot_ptr + b).to(tl.int64) * stride_rs + h * stride_rh + d[:, None] * stride_rk + e[None, :]
    inside = dm[:, None] & em[None, :]
    s = tl.load(at, mask=inside & keep, other=0.0) * tl.exp(g)
    write = beta * (v - tl.sum(k[:, None] * s, axis=0))
    s = s + k[:, None] * write[None, :]
    tl.store(at, s, mask=inside)
    tl.store(o_ptr + (b * tl.num_programs(1) + h) * DV + e, tl.sum(q[:, None] * s, axis=0), mask=em)


@triton.jit
def _chunk_rows(y_ptr, g_ptr, beta_ptr, lo, n, h, eps, R, HK, DK, stride_y, stride_g, stride_beta,
                BT: tl.constexpr, BLOCK_DK: tl.constexpr):
    """A chunk's rows lo .. lo + n - 1 (padded to BT with zeros) for value head h -> k [BT, BLOCK_DK] (normalized),
    beta [BT] and the cumulative log-decay G [BT] (G_last in the padding), float32."""
    i = tl.arange(0, BT)
    d = tl.arange(0, BLOCK_DK)
    rows = (lo + i).to(tl.int64)
    k = tl.load(y_ptr + rows[:, None] * stride_y + (HK + h // R) * DK + d[None, :],
                mask=(i < n)[:, None] & (d < DK)[None, :], other=0.0)
    g = tl.load(g_ptr + rows * stride_g + h, mask=i < n, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + rows * stride_beta + h, mask=i < n, other=0.0).to(tl.float32)
    return _l2_normalize(k.to(tl.float32), eps), beta, tl.cumsum(g, axis=0)


@triton.jit
def _chunk_inverse_kernel(y_ptr, g_ptr, beta_ptr, lo_ptr, hi_ptr, inv_ptr, eps, R, HK, DK, stride_y, stride_g,
                          stride_beta, stride_inv, BT: tl.constexpr, LEVELS: tl.constexpr, BLOCK_DK: tl.constexpr):
    """Program (c, h): chunk c (rows lo[c] .. hi[c] - 1) of value head h -> inv rows lo[c] .. (h: [T, Hv, BT]) the
    inverse of L = I + A (the module docstring), by LEVELS doublings of the inverted diagonal blocks."""
    c = tl.program_id(0)
    h = tl.program_id(1)
    lo = tl.load(lo_ptr + c)
    n = tl.load(hi_ptr + c) - lo
    k, beta, G = _chunk_rows(y_ptr, g_ptr, beta_ptr, lo, n, h, eps, R, HK, DK, stride_y, stride_g, stride_beta, BT,
                             BLOCK_DK)
    i = tl.arange(0, BT)
    below = i[:, None] > i[None, :]
    decay = tl.exp(tl.where(below, G[:, None] - G[None, :], -float("inf")))
    a = beta[:, None] * tl.dot(k, tl.trans(k), input_precision=_PRECISION) * decay  # 0 on and above the diagonal
    inv = tl.where(i[:, None] == i[None, :], 1.0, 0.0)
    size = 1
    for _ in tl.static_range(LEVELS):
        off_block = (i[:, None] // (2 * size) == i[None, :] // (2 * size)) & (i[:, None] // size != i[None, :] // size)
        m = tl.where(off_block, a, 0.0)
        inv = inv - tl.dot(tl.dot(inv, m, input_precision=_PRECISION), inv, input_precision=_PRECISION)
        size = size * 2
    tl.store(inv_ptr + (lo + i)[:, None].to(tl.int64) * stride_inv + h * BT + i[None, :], inv,
             mask=(i < n)[:, None])


@triton.jit
def _chunk_scan_kernel(y_ptr, g_ptr, beta_ptr, inv_ptr, rec_ptr, slot_ptr, flag_ptr, cu_ptr, o_ptr, scale, eps, R,
                       HK, DK, DV, stride_y, stride_g, stride_beta, stride_inv, stride_rs, stride_rh, stride_rk,
                       HAS_FLAGS: tl.constexpr, BT: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_V: tl.constexpr):
    """Program (b, h, vb): sequence b's chunks in order for value head h and state columns vb * BLOCK_V .., from its
    slot's state (the chunk inverses at inv_ptr) -> o [T, Hv, Dv]; the slot's state tile <- the state after them."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    e = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    em = e < DV
    d = tl.arange(0, BLOCK_DK)
    i = tl.arange(0, BT)
    keep = True
    if HAS_FLAGS:
        keep = tl.load(flag_ptr + b) != 0
    at = rec_ptr + tl.load(slot_ptr + b).to(tl.int64) * stride_rs + h * stride_rh + d[:, None] * stride_rk + e[None, :]
    inside = (d < DK)[:, None] & em[None, :]
    s = tl.load(at, mask=inside & keep, other=0.0)
    start = tl.load(cu_ptr + b)
    end = tl.load(cu_ptr + b + 1)
    for lo in range(start, end, BT):
        n = tl.minimum(end - lo, BT)
        rows = (lo + i).to(tl.int64)
        rm = i < n
        k, beta, G = _chunk_rows(y_ptr, g_ptr, beta_ptr, lo, n, h, eps, R, HK, DK, stride_y, stride_g, stride_beta,
                                 BT, BLOCK_DK)
        q = tl.load(y_ptr + rows[:, None] * stride_y + (h // R) * DK + d[None, :],
                    mask=rm[:, None] & (d < DK)[None, :], other=0.0)
        q = _l2_normalize(q.to(tl.float32), eps) * scale
        v = tl.load(y_ptr + rows[:, None] * stride_y + 2 * HK * DK + h * DV + e[None, :],
                    mask=rm[:, None] & em[None, :], other=0.0).to(tl.float32)
        inv = tl.load(inv_ptr + rows[:, None] * stride_inv + h * BT + i[None, :], mask=rm[:, None], other=0.0)
        rhs = beta[:, None] * (v - tl.exp(G)[:, None] * tl.dot(k, s, input_precision=_PRECISION))
        u = tl.dot(inv, rhs, input_precision=_PRECISION)  # [BT, BLOCK_V]: the chunk's writes (0 in the padding)
        decay = tl.exp(tl.where(i[:, None] >= i[None, :], G[:, None] - G[None, :], -float("inf")))
        scores = tl.dot(q, tl.trans(k), input_precision=_PRECISION) * decay
        o = tl.exp(G)[:, None] * tl.dot(q, s, input_precision=_PRECISION)
        o += tl.dot(scores, u, input_precision=_PRECISION)
        tl.store(o_ptr + (rows[:, None] * tl.num_programs(1) + h) * DV + e[None, :], o,
                 mask=rm[:, None] & em[None, :])
        g_last = tl.sum(tl.where(i == BT - 1, G, 0.0), axis=0)  # G_n: the padding's g are 0
        to_end = tl.exp(g_last - G)
        s = tl.exp(g_last) * s + tl.dot(tl.trans(k * to_end[:, None]), u, input_precision=_PRECISION)
    tl.store(at, s, mask=inside)


def _conv_silu(mixed: torch.Tensor, conv_weight: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
               has_state: torch.Tensor | None, cu: torch.Tensor | None, max_len: int) -> torch.Tensor:
    """silu(causal conv1d) of mixed's rows [T, Ch] -> [T, Ch] in mixed's dtype; conv_state's slots rewritten. cu:
    the sequences' row bounds on the device (None: one row per sequence); max_len: the longest's length."""
    T, Ch = mixed.shape
    K = conv_weight.shape[1]
    out = torch.empty(T, Ch, dtype=mixed.dtype, device=mixed.device)
    B = slots.shape[0]
    block_t = min(16, triton.next_power_of_2(max_len))
    block_c = min(128 if block_t == 1 else 32, triton.next_power_of_2(Ch))  # tiles of at most 512 inputs a tap
    _conv_kernel[(B, triton.cdiv(Ch, block_c))](
        mixed, conv_weight, conv_state, out, slots, slots if has_state is None else has_state,
        slots if cu is None else cu, Ch, mixed.stride(0), conv_weight.stride(0), conv_state.stride(0),
        conv_state.stride(1), out.stride(0), K=K, VARLEN=cu is not None, HAS_FLAGS=has_state is not None,
        BLOCK_T=block_t, BLOCK_C=block_c, BLOCK_K=triton.next_power_of_2(K))
    return out


def _check_inputs(mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
                  conv_state: torch.Tensor, recurrent: torch.Tensor, slots: torch.Tensor, num_k_heads: int,
                  has_state: torch.Tensor | None, sequences: int) -> tuple[int, int, int, int]:
    """ValueError unless the tensors fit one another (the entry points' docstrings) -> (Hk, Hv, Dk, Dv)."""
    if recurrent.dim() != 4 or recurrent.dtype != torch.float32 or not recurrent.is_contiguous():
        raise ValueError(f"recurrent is a contiguous float32 [S, Hv, Dk, Dv], got {recurrent.dtype} "
                         f"{tuple(recurrent.shape)}")
    _, hv, dk, dv = recurrent.shape
    ch = 2 * num_k_heads * dk + hv * dv
    if hv % num_k_heads:
        raise ValueError(f"{hv} value heads do not share {num_k_heads} key heads evenly")
    if mixed.dim() != 2 or mixed.shape[1] != ch or mixed.stride(1) != 1:
        raise ValueError(f"mixed is [T, {ch}] (2 Hk Dk + Hv Dv channels) with unit column stride, got "
                         f"{tuple(mixed.shape)} strides {mixed.stride()}")
    tokens = mixed.shape[0]
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (tokens, hv) or t.stride(1) != 1:
            raise ValueError(f"{name} is [{tokens}, {hv}] with unit column stride, got {tuple(t.shape)}")
    if conv_weight.dim() != 2 or conv_weight.shape[0] != ch or conv_weight.stride(1) != 1:
        raise ValueError(f"conv_weight is [{ch}, K] with unit column stride, got {tuple(conv_weight.shape)}")
    kernel = conv_weight.shape[1]
    if (conv_state.shape != (recurrent.shape[0], ch, kernel - 1) or conv_state.stride(2) != 1
            or kernel < 2):
        raise ValueError(f"conv_state is [{recurrent.shape[0]}, {ch}, {kernel - 1}] (one row per slot of "
                         f"recurrent, the kernel's last K - 1 inputs), got {tuple(conv_state.shape)}")
    if slots.shape != (sequences,) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots is an integer [{sequences}], got {slots.dtype} {tuple(slots.shape)}")
    if has_state is not None and has_state.shape != (sequences,):
        raise ValueError(f"has_state is [{sequences}], got {tuple(has_state.shape)}")
    devices = {t.device for t in (mixed, g, beta, conv_weight, conv_state, recurrent, slots)}
    if has_state is not None:
        devices.add(has_state.device)
    if len(devices) != 1:
        raise ValueError(f"the tensors are on one device, got {sorted(map(str, devices))}")
    return num_k_heads, hv, dk, dv


def triton_gated_delta_decode(mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, conv_weight: torch.Tensor,
                              conv_state: torch.Tensor, recurrent: torch.Tensor, slots: torch.Tensor,
                              num_k_heads: int, has_state: torch.Tensor | None = None) -> torch.Tensor:
    """One token of each of B rows: convolution, heads and one step of the rule (the module docstring), in two
    kernels that read nothing on the host (a CUDA graph replays them with new slots and has_state).

    mixed [B, Ch] (any row stride), g [B, Hv] float32, beta [B, Hv], conv_weight [Ch, K] (the layer's
    conv1d.weight[:, 0]), conv_state [S, Ch, K - 1] and recurrent [S, Hv, Dk, Dv] float32 (contiguous: DeltaNetState's
    conv and recurrent), slots [B] int64 (or int32) distinct, has_state [B] bool or None -> o [B, Hv, Dv] float32.
    conv_state[slots] and recurrent[slots] hold the states after the token."""
    hk, hv, dk, dv = _check_inputs(mixed, g, beta, conv_weight, conv_state, recurrent, slots, num_k_heads,
                                   has_state, mixed.shape[0])
    B = mixed.shape[0]
    y = _conv_silu(mixed, conv_weight, conv_state, slots, has_state, None, 1)
    o = torch.empty(B, hv, dv, dtype=torch.float32, device=mixed.device)
    block_v = min(DECODE_BLOCK_V, triton.next_power_of_2(dv))
    _decode_step_kernel[(B, hv, triton.cdiv(dv, block_v))](
        y, g, beta, recurrent, slots, slots if has_state is None else has_state, o, dk ** -0.5, EPS, hv // hk, hk,
        dk, dv, y.stride(0), g.stride(0), beta.stride(0), recurrent.stride(0), recurrent.stride(1),
        recurrent.stride(2), HAS_FLAGS=has_state is not None, BLOCK_DK=triton.next_power_of_2(dk), BLOCK_V=block_v)
    return o


def triton_chunk_gated_delta_rule(mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                                  conv_weight: torch.Tensor, conv_state: torch.Tensor, recurrent: torch.Tensor,
                                  slots: torch.Tensor, cu_seqlens: list[int], num_k_heads: int,
                                  has_state: torch.Tensor | None = None) -> torch.Tensor:
    """B sequences' new tokens: convolution, heads and the chunked rule (the module docstring), each sequence from
    its slot's states.

    mixed [T, Ch] (any row stride), g [T, Hv] float32, beta [T, Hv]: the sequences' tokens one after another,
    sequence b's at rows cu_seqlens[b] .. cu_seqlens[b + 1] - 1 (cu_seqlens: B + 1 non-decreasing ints on the host,
    0 first and T last, the attention layers' Context.cu_seqlens); conv_weight, conv_state, recurrent, slots [B],
    has_state [B] as triton_gated_delta_decode takes them -> o [T, Hv, Dv] float32. conv_state[slots] and
    recurrent[slots] hold the states after each sequence's tokens."""
    cu = list(cu_seqlens)
    bounds = list(itertools.pairwise(cu))
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != mixed.shape[0] or any(a > b for a, b in bounds):
        raise ValueError(f"cu_seqlens runs from 0 to the {mixed.shape[0]} tokens without decreasing, got {cu}")
    hk, hv, dk, dv = _check_inputs(mixed, g, beta, conv_weight, conv_state, recurrent, slots, num_k_heads,
                                   has_state, len(cu) - 1)
    device, T, B = mixed.device, mixed.shape[0], len(cu) - 1
    cu_t = torch.tensor(cu, dtype=torch.int32, device=device)
    y = _conv_silu(mixed, conv_weight, conv_state, slots, has_state, cu_t,
                   max(1, *(b - a for a, b in bounds)))
    starts = [lo for a, b in bounds for lo in range(a, b, CHUNK)]
    ends = [min(lo + CHUNK, b) for a, b in bounds for lo in range(a, b, CHUNK)]
    o = torch.empty(T, hv, dv, dtype=torch.float32, device=device)
    if not starts:
        return o
    inv = torch.empty(T, hv, CHUNK, dtype=torch.float32, device=device)
    common = (EPS, hv // hk, hk, dk)
    _chunk_inverse_kernel[(len(starts), hv)](
        y, g, beta, torch.tensor(starts, dtype=torch.int32, device=device),
        torch.tensor(ends, dtype=torch.int32, device=device), inv, *common, y.stride(0), g.stride(0), beta.stride(0),
        inv.stride(0), BT=CHUNK, LEVELS=CHUNK.bit_length() - 1, BLOCK_DK=max(16, triton.next_power_of_2(dk)))
    block_v = min(PREFILL_BLOCK_V, max(16, triton.next_power_of_2(dv)))
    # num_stages=1: one chunk's tiles in shared memory at a time (prefetched ones would not fit beside them)
    _chunk_scan_kernel[(B, hv, triton.cdiv(dv, block_v))](
        y, g, beta, inv, recurrent, slots, slots if has_state is None else has_state, cu_t, o, dk ** -0.5,
        *common, dv, y.stride(0), g.stride(0), beta.stride(0), inv.stride(0), recurrent.stride(0),
        recurrent.stride(1), recurrent.stride(2), HAS_FLAGS=has_state is not None, BT=CHUNK,
        BLOCK_DK=max(16, triton.next_power_of_2(dk)), BLOCK_V=block_v, num_stages=1)
    return o
