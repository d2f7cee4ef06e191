"""The paged-cache decode kernels (layers/decode_attention_triton.py, rope_triton.py, mla_decode_triton.py)
against float32 torch references written here: each row's keys gathered through its block table into a
contiguous tensor, then plain softmax attention (the window, GQA's groups; MLA: scores over [c, k_pe],
weights over c). Block tables are shuffled (blocks neither contiguous nor in order), rows have different
lengths (1, BS - 1, BS, BS + 1, several chunks), and every cache position no row holds is NaN, so a read
past a row's length or through a wrong table entry shows. The cache writes are checked too: the new rows
equal the reference's normalized / rotated keys, values or latents, and nothing else changed.

A float8 cache (layers/kv_quant.py: e4m3 codes and a float32 scale per token and head, or per latent row) is
made from the same caches by kv_quant.quantize_rows (NaN rows get NaN scales) and checked against the float32
references over its dequantized values (codes x scale), against the unquantized kernels over those values
rounded to the model's dtype (what kv_quant.read_positions gives), and the rows the kernels write against
quantize_rows of the rows the unquantized kernels write, bit for bit.

Sinks (gpt-oss: a logit per query head in each softmax that weighs no value) are checked in the decode kernel over
one chunk and several (where the combine adds them), the one-kernel decode step and the combine alone, against the
reference with each head's sink in its softmax, at sizes where the sinks take a good share of the weight.

Each row has a few "needle" keys (planted where the row sees them) that every query head of the row scores
about log(length) + 1 higher than a typical key, so the needles carry a fixed share of the weight however
long the cache: at 128K keys a chunk, block or tile the kernel skips or misplaces still moves the output.

Runs on CUDA on the GPU host, the long caches (1K to 128K keys) and CUDA graphs there only; elsewhere on the
CPU under Triton's interpreter (TRITON_INTERPRET=1, triton installed), small caches only.

B rows, Hq query heads, Hkv key/value heads, Dk / Dv head dims, N MLA heads, R kv_lora_rank, P
qk_rope_head_dim, NB blocks of BS positions, S slots, M blocks per slot's table.
"""

import functools
import math

import pytest
import torch
from kernels_device import kernels_device

DEVICE = kernels_device()

from hybridmoe.layers.decode_attention_triton import (  # triton: imported once it is known to be there
    CHUNK,
    combine_chunks,
    triton_decode_attention,
    triton_rope_decode_attention,
)
from hybridmoe.layers.kv_quant import FP8, quantize_rows
from hybridmoe.layers.mla_decode_triton import MIN_CHUNK, chunk_len, triton_mla_decode
from hybridmoe.layers.rope_triton import triton_norm_rope_cache

pytestmark = pytest.mark.device
cuda_only = pytest.mark.skipif(DEVICE != "cuda", reason="a long cache: on the GPU only")

TOL = {torch.float32: {"atol": 1e-4, "rtol": 1e-4}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
KEYS = [1, 1024, 32768, 131072]
"""The GPU's cache lengths: the longest row of a device case."""


@pytest.fixture(autouse=True)
def _interpreter_dots_take_bfloat16_values(monkeypatch):
    """On the CPU: Triton's interpreter keeps bfloat16 tensors as their uint16 bits and its tl.dot multiplies
    those bits (triton-lang/triton#11584; its docs: no bfloat16 arithmetic), so a dot's bfloat16 operands go
    in as their float32 values here, which is what the GPU's MMA multiplies (exactly, accumulating in float32).
    Every other bfloat16 step of the kernels (loads, stores, roundings) runs as the interpreter has it."""
    if DEVICE != "cpu":
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    dot = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, *args):
        a, b = (interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
                if x.dtype == tl.bfloat16 else x for x in (a, b))
        return dot(self, a, b, d, *args)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


@pytest.fixture(autouse=True)
def _interpreter_rounds_to_float8_to_nearest_even(monkeypatch):
    """On the CPU: Triton's interpreter rounds float32 to float8 e4m3 half up and drops the carry when the
    mantissa rounds over (126.6 -> 64; triton 3.9's interpreter._convert_float), so a float32 -> e4m3 cast
    takes torch's conversion here: round to nearest even, as the GPU's cvt.rn does for the kernels' values
    (at most e4m3's largest, 448)."""
    if DEVICE != "cpu":
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    to_fp = interpreter.InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if dst_type.scalar != tl.float8e4nv or src.dtype.scalar != tl.float32:
            return to_fp(self, src, dst_type, rounding_mode)
        codes = torch.from_numpy(np.array(src.data, dtype=np.float32)).to(FP8).view(torch.uint8).numpy()
        return interpreter.TensorHandle(codes, dst_type.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fp_to_fp", create_fp_to_fp)


def flat_rows(table: torch.Tensor, slot: int, pos: torch.Tensor, bs: int) -> torch.Tensor:
    """The cache rows (block * BS + offset) of positions pos of the sequence in slot: table [S, M]."""
    pos = pos.to(table.device)
    return table[slot].long()[pos // bs] * bs + pos % bs


def block_table(slots: list[int], lens: list[int], bs: int, num_slots: int, g: torch.Generator):
    """A shuffled block table [S, M] int32 giving the rows their blocks (0 past each row's blocks, and for
    unused slots) and the cache's block count NB: block 0 (scratch) and two spare blocks are no row's."""
    counts = [-(-n // bs) for n in lens]
    num_blocks = 3 + sum(counts)
    order = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    table = torch.zeros(num_slots, max(counts) + 1, dtype=torch.int32)
    for slot, count in zip(slots, counts):
        table[slot, :count] = torch.tensor(order[:count])
        order = order[count:]
    return table, num_blocks


def filled_cache(shape: tuple, table: torch.Tensor, slots: list[int], filled: list[int], dtype: torch.dtype,
                 g: torch.Generator) -> torch.Tensor:
    """A cache of shape [NB, BS, ...] on DEVICE: standard normal at positions 0 .. filled[b] - 1 of each row's
    slot (drawn on DEVICE, from a seed g draws), NaN everywhere else."""
    draw = torch.Generator(DEVICE).manual_seed(int(torch.randint(2 ** 62, (1,), generator=g)))
    cache = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    flat = cache.view(-1, *shape[2:])
    for slot, n in zip(slots, filled):
        rows = flat_rows(table.to(DEVICE), slot, torch.arange(n), shape[1])
        flat[rows] = torch.randn(n, *shape[2:], generator=draw, device=DEVICE).to(dtype)
    return cache


def grouped(rows: int, groups: int, size: int, dim: int, g: torch.Generator) -> torch.Tensor:
    """[rows, groups * size, dim] float32: the size heads of a group near one another (a shared vector plus
    noise of half its scale), so one key can stand out for all of them."""
    base = torch.randn(rows, groups, 1, dim, generator=g)
    return (base + 0.5 * torch.randn(rows, groups, size, dim, generator=g)).flatten(1, 2)


def plant_needles(flat: torch.Tensor, q: torch.Tensor, rows: torch.Tensor, n: int, scale: float) -> None:
    """Write the needle key into the cache rows rows (flat [NB * BS, dim]; q [heads, dim] float32, the queries
    that read it): along their mean, long enough that each scores at least log(n) + 1."""
    u = q.mean(0)
    u = u / u.norm()
    flat[rows] = (u * (math.log(n) + 1) / (scale * (q @ u).min().clamp(min=0.1))).to(flat.dtype)


def needle_rows(table: torch.Tensor, slot: int, lo: int, hi: int, bs: int, g: torch.Generator) -> torch.Tensor:
    """The cache rows of three needles of the row in slot: its first position in [lo, hi) and two random ones."""
    if hi <= lo:
        return torch.zeros(0, dtype=torch.long)
    pos = torch.cat([torch.tensor([lo]), torch.randint(lo, hi, (2,), generator=g)]).unique()
    return flat_rows(table, slot, pos, bs).to(DEVICE)


def rows_setup(lens: list[int], bs: int, g: torch.Generator):
    """Rows in shuffled slots of a shuffled block table: (slots list, slots [B], lens [B], table [S, M], NB),
    the tensors on DEVICE."""
    num_slots = len(lens) + 2
    slots = torch.randperm(num_slots, generator=g)[:len(lens)].tolist()
    table, num_blocks = block_table(slots, lens, bs, num_slots, g)
    return slots, torch.tensor(slots, device=DEVICE), torch.tensor(lens, device=DEVICE), table.to(DEVICE), num_blocks


def unchanged_but(new: torch.Tensor, old: torch.Tensor, rows: torch.Tensor) -> None:
    """new equals old (NaN for NaN) in every flat row but rows."""
    keep = torch.ones(new.shape[0] * new.shape[1], dtype=torch.bool, device=new.device)
    keep[rows] = False
    torch.testing.assert_close(new.flatten(0, 1)[keep], old.flatten(0, 1)[keep], rtol=0, atol=0, equal_nan=True)


def same_codes(new: torch.Tensor, old: torch.Tensor, rows: torch.Tensor) -> None:
    """The float8 cache new holds old's codes (NaN's too) in every flat row but rows."""
    unchanged_but(new.view(torch.uint8), old.view(torch.uint8), rows)


def dequantized(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A float8 cache's values in float32: codes x their rows' scales (NaN where no row is held)."""
    return codes.float() * scales


def ref_attention(q, k_cache, v_cache, table, slots, lens, scale, window, sinks=None):
    """q [B, Hq, Dk] over each row's keys at positions [max(0, n - window), n) gathered through table (float32)
    -> [B, Hq, Dv]. sinks [Hq]: one more logit in each head's softmax, which weighs no value."""
    Hq, DK = q.shape[1:]
    bs, Hkv = k_cache.shape[1], k_cache.shape[2]
    out = []
    for b, (slot, n) in enumerate(zip(slots, lens)):
        pos = torch.arange(max(0, n - window) if window else 0, n, device=q.device)
        rows = flat_rows(table, slot, pos, bs)
        k, v = k_cache.flatten(0, 1)[rows].float(), v_cache.flatten(0, 1)[rows].float()  # [n, Hkv, D]
        s = torch.einsum("kgd,nkd->kgn", q[b].float().view(Hkv, Hq // Hkv, DK), k) * scale
        if sinks is not None:
            s = torch.cat([s, sinks.float().view(Hkv, Hq // Hkv, 1)], dim=-1)
        p = s.softmax(dim=-1)[..., :len(pos)]
        out.append(torch.einsum("kgn,nkd->kgd", p, v).reshape(Hq, -1))
    return torch.stack(out)


def sink_logits(heads: int, lens: list[int], g: torch.Generator) -> torch.Tensor:
    """[heads] float32 on DEVICE: about log(longest row) + 1, near a needle's score, so each head's sink takes a
    large share of its softmax (some heads more, some less)."""
    return (math.log(max(lens)) + 1 + torch.randn(heads, generator=g)).to(DEVICE)


def ref_norm_rope(x, weight, eps, positions, inv_freq, scaling):
    """Heads x [T, H, D] float32 -> RMS-normalized (weight not None) and rotated (neox: halves together)."""
    if weight is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    angle = positions.float()[:, None] * inv_freq[None, :]  # [T, D / 2]
    cos = (torch.cat((angle, angle), -1).cos() * scaling)[:, None]
    sin = (torch.cat((angle, angle), -1).sin() * scaling)[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), -1) * sin


def inv_freq(dim: int) -> torch.Tensor:
    return (1.0 / 1e4 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)).to(DEVICE)


def gqa_cases():
    """(lens, max_len, bs, (Hq, Hkv, Dk, Dv)): lengths at the block edges, several chunks on the interpreter;
    1 to 128K keys on the GPU."""
    small, real = (8, 2, 64, 64), (32, 4, 128, 128)
    cases = []
    for bs in (16, 64):
        cases.append(([1, bs - 1, bs, bs + 1, 3 * bs + 5], CHUNK, bs, small))
        # two chunks, the second empty for short rows (the first for long ones in a window); Dk != Dv
        cases.append(([CHUNK + 1, 2 * CHUNK - 3, bs + 1, 1], 2 * CHUNK, bs, (8, 2, 32, 16)))
        cases += [pytest.param([n, n // 3 + 1, 1], n, bs, real, marks=cuda_only, id=f"{n}keys-bs{bs}")
                  for n in KEYS]
    return cases


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("lens,max_len,bs,shape", gqa_cases())
def test_decode_attention_reads_the_rows_blocks(lens, max_len, bs, shape, window, dtype):
    Hq, DV = shape[0], shape[3]
    g = torch.Generator().manual_seed(len(lens) * bs + max_len)
    slots, slots_t, lens_t, table, k, v, q, scale = gqa_cache(lens, bs, shape, window, dtype, g)
    k0, v0 = k.clone(), v.clone()
    got = triton_decode_attention(q, k, v, table, slots_t, lens_t, scale, window, max_len)
    assert got.shape == (len(lens), Hq, DV) and got.dtype == dtype
    torch.testing.assert_close(got.float(), ref_attention(q, k0, v0, table, slots, lens, scale, window), **TOL[dtype])
    unchanged_but(k, k0, torch.zeros(0, dtype=torch.long))
    unchanged_but(v, v0, torch.zeros(0, dtype=torch.long))


def sink_cases():
    """(lens, max_len, bs, (Hq, Hkv, Dk, Dv)) with sinks: one chunk, two (the combine adds the sinks), a long cache
    on the GPU."""
    return [([1, 15, 16, 17, 53], CHUNK, 16, (8, 2, 64, 64)),
            ([CHUNK + 1, 2 * CHUNK - 3, 17, 1], 2 * CHUNK, 16, (8, 2, 32, 16)),
            pytest.param([32768, 1000, 1], 32768, 64, (64, 8, 64, 64), marks=cuda_only, id="32768keys-sinks")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("lens,max_len,bs,shape", sink_cases())
def test_decode_attention_adds_each_heads_sink_to_its_softmax(lens, max_len, bs, shape, window, dtype):
    Hq, DV = shape[0], shape[3]
    g = torch.Generator().manual_seed(len(lens) * bs + max_len + 1)
    slots, slots_t, lens_t, table, k, v, q, scale = gqa_cache(lens, bs, shape, window, dtype, g)
    sinks = sink_logits(Hq, lens, g)
    got = triton_decode_attention(q, k, v, table, slots_t, lens_t, scale, window, max_len, sinks=sinks)
    assert got.shape == (len(lens), Hq, DV) and got.dtype == dtype
    want = ref_attention(q, k, v, table, slots, lens, scale, window, sinks)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])
    without = ref_attention(q, k, v, table, slots, lens, scale, window)
    assert (want - without).abs().max() > 20 * TOL[dtype]["atol"]  # the sinks move the output past the tolerance
    same_dtype = triton_decode_attention(q, k, v, table, slots_t, lens_t, scale, window, max_len, sinks=sinks.to(dtype))
    torch.testing.assert_close(same_dtype.float(), ref_attention(q, k, v, table, slots, lens, scale, window,
                                                                 sinks.to(dtype)), **TOL[dtype])


def gqa_cache(lens, bs, shape, window, dtype, g):
    """A decode step's inputs over a shuffled paged cache (Hq, Hkv, Dk, Dv: shape) holding each row's lens keys
    and needles for its queries q [B, Hq, Dk]: (slots list, slots [B], lens [B], table, k, v, q, scale)."""
    Hq, Hkv, DK, DV = shape
    slots, slots_t, lens_t, table, num_blocks = rows_setup(lens, bs, g)
    k = filled_cache((num_blocks, bs, Hkv, DK), table, slots, lens, dtype, g)
    v = filled_cache((num_blocks, bs, Hkv, DV), table, slots, lens, dtype, g)
    q = grouped(len(lens), Hkv, Hq // Hkv, DK, g).to(DEVICE, dtype)
    plant_group_needles(k, q.float(), table, slots, lens, window, 0, g)
    return slots, slots_t, lens_t, table, k, v, q, DK ** -0.5


def plant_group_needles(k, q, table, slots, lens, window, new, g):
    """Needles for the queries q [B, Hq, Dk] float32 of each key/value head in k [NB, BS, Hkv, Dk], at
    positions that each row's window sees, before its last new ones (new: 1 where the new token is not
    cached yet, else 0)."""
    Hq, Hkv, bs = q.shape[1], k.shape[2], k.shape[1]
    for b, (slot, n) in enumerate(zip(slots, lens)):
        rows = needle_rows(table, slot, max(0, n - window) if window else 0, n - new, bs, g)
        for kh in range(Hkv):
            plant_needles(k.flatten(0, 1)[:, kh], q[b, kh * Hq // Hkv:(kh + 1) * Hq // Hkv], rows, n,
                          k.shape[-1] ** -0.5)


def fp8_gqa_cases():
    """(lens, max_len, bs, (Hq, Hkv, Dk, Dv)) on a float8 cache: block edges at three block sizes, GQA groups
    of 1, 3, 4 and 8 heads (head dims not powers of two too), two chunks."""
    return [([1, 15, 16, 17, 53], CHUNK, 16, (8, 2, 64, 64)),
            ([33, 2, 95, 32], CHUNK, 32, (6, 2, 48, 48)),
            ([1, 63, 64, 65], CHUNK, 64, (4, 4, 32, 32)),
            ([CHUNK + 1, 2 * CHUNK - 3, 17, 1], 2 * CHUNK, 16, (8, 1, 32, 16)),
            pytest.param([32768, 1000, 1], 32768, 64, (32, 4, 128, 128), marks=cuda_only, id="32768keys-fp8")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("lens,max_len,bs,shape", fp8_gqa_cases())
def test_decode_attention_reads_a_fp8_cache_through_its_scales(lens, max_len, bs, shape, window, dtype):
    """The float32 reference over the dequantized cache; the unquantized kernel over it in the model's dtype."""
    Hq, DV = shape[0], shape[3]
    g = torch.Generator().manual_seed(len(lens) * bs + max_len + Hq)
    slots, slots_t, lens_t, table, k, v, q, scale = gqa_cache(lens, bs, shape, window, dtype, g)
    (k8, ks), (v8, vs) = quantize_rows(k), quantize_rows(v)
    k0, ks0, v0, vs0 = k8.clone(), ks.clone(), v8.clone(), vs.clone()
    got = triton_decode_attention(q, k8, v8, table, slots_t, lens_t, scale, window, max_len, ks, vs)
    assert got.shape == (len(lens), Hq, DV) and got.dtype == dtype
    want = ref_attention(q, dequantized(k8, ks), dequantized(v8, vs), table, slots, lens, scale, window)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])
    plain = triton_decode_attention(q, dequantized(k8, ks).to(dtype), dequantized(v8, vs).to(dtype), table, slots_t,
                                    lens_t, scale, window, max_len)
    torch.testing.assert_close(got, plain, **TOL[dtype])
    none = torch.zeros(0, dtype=torch.long)
    same_codes(k8, k0, none)
    same_codes(v8, v0, none)
    unchanged_but(ks, ks0, none)
    unchanged_but(vs, vs0, none)


def test_kernels_refuse_a_fp8_cache_without_its_scales():
    """Float8 codes without their scales, scales of another shape or beside a cache in the model's dtype."""
    q = torch.zeros(1, 4, 16, device=DEVICE)
    one = torch.ones(1, dtype=torch.long, device=DEVICE)
    table = torch.ones(1, 2, dtype=torch.int32, device=DEVICE)
    k8, ks = quantize_rows(torch.ones(3, 16, 2, 16, device=DEVICE))
    for args in [(k8, k8, None, None), (k8, k8, ks, None), (k8, k8, ks, ks[..., :1, :]), (k8.float(), k8, ks, ks)]:
        with pytest.raises(ValueError, match="float8"):
            triton_decode_attention(q, args[0], args[1], table, one, one, 0.25, None, 1, args[2], args[3])
    z = torch.zeros
    mla = (z(1, 4, 32, device=DEVICE), z(1, 4, 16, device=DEVICE), z(1, 32, device=DEVICE), z(1, 16, device=DEVICE),
           z(32, device=DEVICE), 1e-6, one - 1, inv_freq(16), 1.0, True)
    lat8, lat_s = quantize_rows(torch.ones(3, 16, 48, device=DEVICE))
    for cache, scales in [(lat8, None), (lat8, lat_s[:, :8]), (lat8.float(), lat_s)]:
        with pytest.raises(ValueError, match="float8"):
            triton_mla_decode(*mla, cache, table, one, one, 0.25, 1, scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_chunks_equals_one_softmax_over_all_keys(dtype):
    """The partial sums of 37 chunks (several tiles of them; about a third of the chunks without a key: max
    -inf, total 0) combine into the softmax over every key at once, in the output's dtype."""
    g = torch.Generator().manual_seed(37)
    rows, NC, L, D = 5, 37, 8, 48
    s = 3 * torch.randn(rows, NC, L, generator=g)
    empty = torch.rand(rows, NC, generator=g) < 0.3
    empty[:, 0] = False
    s[empty] = -float("inf")
    v = torch.randn(rows, NC, L, D, generator=g)
    m = s.amax(-1)
    p = torch.where(empty[..., None], 0.0, (s - m[..., None]).exp())
    out = torch.empty(rows, D, dtype=dtype, device=DEVICE)
    combine_chunks(torch.einsum("rcl,rcld->rcd", p, v).to(DEVICE), m.to(DEVICE), p.sum(-1).to(DEVICE), out)
    want = torch.einsum("rk,rkd->rd", s.flatten(1).softmax(-1), v.flatten(1, 2))
    torch.testing.assert_close(out.float().cpu(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_chunks_adds_each_rows_sink_once(dtype):
    """Rows of (sequence, head) pairs, 3 heads: row r's softmax over every key of its 37 chunks and the logit
    sinks[r % 3], one sink below the chunks' maxima, one near them, one above them all."""
    g = torch.Generator().manual_seed(38)
    rows, NC, L, D, heads = 6, 37, 8, 48, 3
    s = 3 * torch.randn(rows, NC, L, generator=g)
    empty = torch.rand(rows, NC, generator=g) < 0.3
    empty[:, 0] = False
    s[empty] = -float("inf")
    v = torch.randn(rows, NC, L, D, generator=g)
    m = s.amax(-1)
    p = torch.where(empty[..., None], 0.0, (s - m[..., None]).exp())
    sinks = torch.tensor([-4.0, 6.0, 14.0])
    out = torch.empty(rows, D, dtype=dtype, device=DEVICE)
    combine_chunks(torch.einsum("rcl,rcld->rcd", p, v).to(DEVICE), m.to(DEVICE), p.sum(-1).to(DEVICE), out,
                   sinks.to(DEVICE))
    logits = torch.cat([s.flatten(1), sinks.repeat(rows // heads)[:, None]], dim=1)
    want = torch.einsum("rk,rkd->rd", logits.softmax(-1)[:, :-1], v.flatten(1, 2))
    torch.testing.assert_close(out.float().cpu(), want, **TOL[dtype])


def gqa_step(lens, bs, heads, qk_norm, window, dtype, g):
    """A decode step's inputs: rows of lens (new token at lens - 1) in a shuffled paged cache, filled before
    the new tokens and carrying needles for the reference's queries, NaN elsewhere; the reference's rotated
    q and k of the new tokens and the rows they go to."""
    Hq, Hkv, D = heads
    slots, slots_t, lens_t, table, num_blocks = rows_setup(lens, bs, g)
    k = filled_cache((num_blocks, bs, Hkv, D), table, slots, [n - 1 for n in lens], dtype, g)
    v = filled_cache((num_blocks, bs, Hkv, D), table, slots, [n - 1 for n in lens], dtype, g)
    qkv = torch.cat([grouped(len(lens), Hkv, Hq // Hkv, D, g).flatten(1),
                     torch.randn(len(lens), 2 * Hkv * D, generator=g)], 1).to(DEVICE, dtype)
    q_w, k_w = (1 + 0.1 * torch.randn(2, D, generator=g)).to(DEVICE, dtype) if qk_norm else (None, None)
    rope = (q_w, k_w, 1e-6, lens_t - 1, inv_freq(D), 0.9)
    heads = qkv.float().view(len(lens), Hq + 2 * Hkv, D)
    q_ref = ref_norm_rope(heads[:, :Hq], q_w, *rope[2:])
    k_ref = ref_norm_rope(heads[:, Hq:Hq + Hkv], k_w, *rope[2:])
    plant_group_needles(k, q_ref, table, slots, lens, window, 1, g)
    token_row = torch.stack([flat_rows(table, s, torch.tensor(n - 1), bs) for s, n in zip(slots, lens)])
    return slots, slots_t, lens_t, table, k, v, qkv, rope, q_ref, k_ref, token_row


def rope_cases():
    cases = []
    for bs in (16, 64):
        cases.append(([1, bs - 1, bs, bs + 1, 2 * bs + 3], bs, (8, 2, 64)))
        cases.append(pytest.param([CHUNK, 1, 300], bs, (32, 4, 128), marks=cuda_only, id=f"chunk-bs{bs}"))
    return cases


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm,window", [(True, None), (False, None), (True, 5)])
@pytest.mark.parametrize("lens,bs,heads", rope_cases())
def test_rope_decode_attention_writes_the_new_row_and_reads_the_blocks(lens, bs, heads, qk_norm, window, dtype):
    """The one kernel equals the reference, and the two kernels it stands for: the same cache (bit for bit)
    and output."""
    Hq, Hkv, D = heads
    g = torch.Generator().manual_seed(len(lens) * bs + Hq)
    slots, slots_t, lens_t, table, k, v, qkv, rope, q_ref, k_ref, token_row = gqa_step(lens, bs, heads, qk_norm,
                                                                                       window, dtype, g)
    k0, v0 = k.clone(), v.clone()
    scale = D ** -0.5
    got = triton_rope_decode_attention(qkv, Hq, Hkv, D, *rope, k, v, token_row, table, slots_t, lens_t, scale, window)
    k2, v2 = k0.clone(), v0.clone()
    q = triton_norm_rope_cache(qkv, Hq, Hkv, D, *rope, k2, v2, token_row)
    two = triton_decode_attention(q, k2, v2, table, slots_t, lens_t, scale, window, CHUNK)
    torch.testing.assert_close(k, k2, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v, v2, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got, two, **TOL[dtype])
    torch.testing.assert_close(k.flatten(0, 1)[token_row].float(), k_ref, **TOL[dtype])
    assert torch.equal(v.flatten(0, 1)[token_row], qkv[:, (Hq + Hkv) * D:].view(-1, Hkv, D))
    unchanged_but(k, k0, token_row)
    unchanged_but(v, v0, token_row)
    torch.testing.assert_close(got.float(), ref_attention(q_ref, k, v, table, slots, lens, scale, window),
                               **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("lens,bs,heads", rope_cases())
def test_rope_decode_attention_adds_each_heads_sink(lens, bs, heads, window, dtype):
    """The one kernel with sinks equals the two kernels it stands for with the same sinks, and the reference with
    each head's sink in its softmax over the queries they attend with (rounded to dtype: a sink near the keys' scores
    turns the queries' rounding into as much of the output in bfloat16 as the tolerance; the rotation itself is
    test_rope_decode_attention_writes_the_new_row_and_reads_the_blocks')."""
    Hq, Hkv, D = heads
    g = torch.Generator().manual_seed(len(lens) * bs + Hq + 2)
    slots, slots_t, lens_t, table, k, v, qkv, rope, q_ref, _, token_row = gqa_step(lens, bs, heads, True, window,
                                                                                   dtype, g)
    k2, v2 = k.clone(), v.clone()
    sinks = sink_logits(Hq, lens, g)
    scale = D ** -0.5
    got = triton_rope_decode_attention(qkv, Hq, Hkv, D, *rope, k, v, token_row, table, slots_t, lens_t, scale, window,
                                       sinks=sinks)
    q = triton_norm_rope_cache(qkv, Hq, Hkv, D, *rope, k2, v2, token_row)
    two = triton_decode_attention(q, k2, v2, table, slots_t, lens_t, scale, window, CHUNK, sinks=sinks)
    torch.testing.assert_close(got, two, **TOL[dtype])
    torch.testing.assert_close(q.float(), q_ref, **TOL[dtype])
    want = ref_attention(q, k, v, table, slots, lens, scale, window, sinks)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])
    assert (want - ref_attention(q, k, v, table, slots, lens, scale, window)).abs().max() > 20 * TOL[dtype]["atol"]


def test_kernels_refuse_sinks_that_are_not_one_logit_per_query_head():
    q = torch.zeros(1, 4, 16, device=DEVICE)
    one = torch.ones(1, dtype=torch.long, device=DEVICE)
    table = torch.ones(1, 2, dtype=torch.int32, device=DEVICE)
    k = torch.zeros(3, 16, 2, 16, device=DEVICE)
    for sinks in (torch.zeros(2, device=DEVICE), torch.zeros(4, dtype=torch.long, device=DEVICE),
                  torch.zeros(8, device=DEVICE)[::2]):
        with pytest.raises(ValueError, match="sinks must be"):
            triton_decode_attention(q, k, k, table, one, one, 0.25, None, 1, sinks=sinks)


def assert_quantized_rows(codes: torch.Tensor, scales: torch.Tensor, plain: torch.Tensor, rows: torch.Tensor) -> None:
    """The float8 cache's flat rows rows (codes, scales) hold kv_quant.quantize_rows of the unquantized cache plain's,
    bit for bit."""
    want_codes, want_scales = quantize_rows(plain.flatten(0, 1)[rows])
    assert torch.equal(codes.flatten(0, 1)[rows].view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(scales.flatten(0, 1)[rows], want_scales)


def fp8_rope_cases():
    return [([1, 15, 16, 17, 35], 16, (8, 2, 64)), ([1, 63, 64, 65], 64, (6, 6, 32)),
            pytest.param([CHUNK, 1, 300], 64, (32, 4, 128), marks=cuda_only, id="chunk-fp8")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm,window", [(True, None), (False, 5)])
@pytest.mark.parametrize("lens,bs,heads", fp8_rope_cases())
def test_rope_decode_attention_writes_the_new_row_into_a_fp8_cache(lens, bs, heads, qk_norm, window, dtype):
    """The new key and value written as quantize_rows writes the unquantized kernels' (bit for bit), nothing else
    changed; the output equals the float32 reference over the dequantized cache, and the two kernels (the rows
    quantized between them, as Attention runs a float8 cache past CHUNK positions)."""
    Hq, Hkv, D = heads
    g = torch.Generator().manual_seed(len(lens) * bs + Hq)
    slots, slots_t, lens_t, table, k, v, qkv, rope, q_ref, _, token_row = gqa_step(lens, bs, heads, qk_norm,
                                                                                   window, dtype, g)
    (k8, ks), (v8, vs) = quantize_rows(k), quantize_rows(v)
    k0, ks0, v0, vs0 = k8.clone(), ks.clone(), v8.clone(), vs.clone()
    scale = D ** -0.5
    got = triton_rope_decode_attention(qkv, Hq, Hkv, D, *rope, k8, v8, token_row, table, slots_t, lens_t, scale,
                                       window, ks, vs)
    k2, v2 = dequantized(k0, ks0).to(dtype), dequantized(v0, vs0).to(dtype)
    q = triton_norm_rope_cache(qkv, Hq, Hkv, D, *rope, k2, v2, token_row)
    assert_quantized_rows(k8, ks, k2, token_row)
    assert_quantized_rows(v8, vs, v2, token_row)
    same_codes(k8, k0, token_row)
    same_codes(v8, v0, token_row)
    unchanged_but(ks, ks0, token_row)
    unchanged_but(vs, vs0, token_row)
    want = ref_attention(q_ref, dequantized(k8, ks), dequantized(v8, vs), table, slots, lens, scale, window)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])
    two = triton_decode_attention(q, k8, v8, table, slots_t, lens_t, scale, window, CHUNK, ks, vs)
    torch.testing.assert_close(got, two, **TOL[dtype])


@pytest.mark.skipif(DEVICE != "cuda", reason="Attention's fused path: on the GPU only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused_layer", [True, False])
@pytest.mark.parametrize("max_len", [CHUNK, 4 * CHUNK])
def test_attention_on_a_fp8_cache_takes_the_kernels_and_equals_its_torch_ops(max_len, fused_layer, dtype):
    """Attention's decode step on a float8 cache (fused on: the one kernel up to CHUNK positions with fused_layer,
    else torch's rotary and cache write, then the decode kernel) against the module with fused off: the same
    output, and caches within a step of e4m3 where their rows in the model's dtype differ by an ulp."""
    from hybridmoe.forward_context import Context, DecodeBatch, use_context
    from hybridmoe.layers.attention import Attention

    bs, lens = 64, [max_len - 3, 9, 1]
    g = torch.Generator().manual_seed(max_len)
    _, slots_t, lens_t, table, num_blocks = rows_setup(lens, bs, g)
    torch.manual_seed(0)
    a = Attention(512, 8, 2, 128, {"rope_type": "default", "rope_theta": 1e6}, qk_norm_eps=1e-6).to(DEVICE, dtype)
    a.allocate_kv_cache(num_blocks, bs, quantized=True)
    cache = a.kv_cache
    filled = [*quantize_rows(torch.randn(cache.k.shape, device=DEVICE)),
              *quantize_rows(torch.randn(cache.v.shape, device=DEVICE))]
    x = torch.randn(len(lens), 512, generator=g).to(DEVICE, dtype)
    ctx = Context(slot_ids=[], start_pos=[], cu_seqlens=[0], decode=DecodeBatch(slots_t, lens_t, max_len),
                  block_table=table)
    outs = []
    for fused in (True, False):
        for dst, src in zip((cache.k, cache.k_scale, cache.v, cache.v_scale), filled):
            dst.copy_(src)
        a.fused, a.fused_layer = fused, fused_layer and fused
        with use_context(ctx), torch.no_grad():
            outs.append((a(x, lens_t - 1), dequantized(cache.k, cache.k_scale), dequantized(cache.v, cache.v_scale)))
    (got, got_k, got_v), (want, want_k, want_v) = outs
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(got_k, want_k, atol=TOL[dtype]["atol"], rtol=TOL[dtype]["rtol"] + 2 ** -3)
    torch.testing.assert_close(got_v, want_v, rtol=0, atol=0)


@pytest.mark.skipif(DEVICE != "cuda", reason="Attention's fused path: on the GPU only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused_layer", [True, False])
@pytest.mark.parametrize("max_len", [CHUNK, 4 * CHUNK])
def test_attention_with_sinks_decodes_in_the_kernels_as_in_its_torch_ops(max_len, fused_layer, dtype):
    """gpt-oss's attention (sinks, q/k/v/o biases, a window) in a decode step: fused (the one kernel up to CHUNK
    positions with fused_layer, else the norm/rotary/cache kernel and the decode kernel, chunks combined past CHUNK)
    against the module with fused off (torch's _attend_decode): the same output and caches."""
    from hybridmoe.forward_context import Context, DecodeBatch, use_context
    from hybridmoe.layers.attention import Attention

    bs, lens = 64, [max_len - 3, 9, 1]
    g = torch.Generator().manual_seed(max_len + 1)
    _, slots_t, lens_t, table, num_blocks = rows_setup(lens, bs, g)
    torch.manual_seed(0)
    a = Attention(256, 8, 2, 64, {"rope_type": "default", "rope_theta": 1e4}, qkv_bias=True, o_bias=True,
                  sliding_window=300, sinks=True).to(DEVICE, dtype)
    with torch.no_grad():
        a.sinks.copy_(math.log(max_len) + torch.randn(8, generator=g))
    assert a.fits_kernels
    a.allocate_kv_cache(num_blocks, bs)
    filled = [torch.randn(a.kv_cache.k.shape, generator=g).to(DEVICE, dtype) for _ in range(2)]
    x = torch.randn(len(lens), 256, generator=g).to(DEVICE, dtype)
    ctx = Context(slot_ids=[], start_pos=[], cu_seqlens=[0], decode=DecodeBatch(slots_t, lens_t, max_len),
                  block_table=table)
    outs = []
    for fused in (True, False):
        a.kv_cache.k.copy_(filled[0])
        a.kv_cache.v.copy_(filled[1])
        a.fused, a.fused_layer = fused, fused_layer and fused
        with use_context(ctx), torch.no_grad():
            outs.append((a(x, lens_t - 1), a.kv_cache.k.clone(), a.kv_cache.v.clone()))
    for got, want in zip(*outs):
        torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("bs", [16, 64])
def test_norm_rope_cache_writes_each_token_at_its_row(bs, qk_norm, dtype):
    """A prefill's tokens (two sequences, positions from 0 and across a block edge): q returned, k and v at
    token_row."""
    Hq, Hkv, D = 8, 2, 64
    g = torch.Generator().manual_seed(bs)
    positions = torch.cat([torch.arange(3), torch.arange(bs - 2, bs + 3)]).to(DEVICE)
    T = positions.shape[0]
    num_blocks = 9
    k = torch.randn(num_blocks, bs, Hkv, D, generator=g).to(DEVICE, dtype)
    v = torch.randn(num_blocks, bs, Hkv, D, generator=g).to(DEVICE, dtype)
    token_row = torch.randperm(num_blocks * bs, generator=g)[:T].to(DEVICE)
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(DEVICE, dtype)
    weights = (1 + 0.1 * torch.randn(2, D, generator=g)).to(DEVICE, dtype) if qk_norm else (None, None)
    k0, v0 = k.clone(), v.clone()
    q = triton_norm_rope_cache(qkv, Hq, Hkv, D, weights[0], weights[1], 1e-6, positions, inv_freq(D), 0.9, k, v,
                               token_row)
    heads = qkv.float().view(T, Hq + 2 * Hkv, D)
    torch.testing.assert_close(q.float(), ref_norm_rope(heads[:, :Hq], weights[0], 1e-6, positions, inv_freq(D), 0.9),
                               **TOL[dtype])
    torch.testing.assert_close(k.flatten(0, 1)[token_row].float(), ref_norm_rope(
        heads[:, Hq:Hq + Hkv], weights[1], 1e-6, positions, inv_freq(D), 0.9), **TOL[dtype])
    assert torch.equal(v.flatten(0, 1)[token_row], qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D))
    unchanged_but(k, k0, token_row)
    unchanged_but(v, v0, token_row)


def ref_mla_rotate(x, positions, freq, scaling, interleaved):
    """Rotary pairs of x [B, ..., P] float32 (interleaved: (x0, x1), ...; else the halves) -> [first | second]."""
    half = x.shape[-1] // 2
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])
    angle = (positions.float()[:, None] * freq[None, :]).view(-1, *[1] * (x.dim() - 2), half)
    cos, sin = angle.cos() * scaling, angle.sin() * scaling
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


def ref_mla(q_abs, q_pe, latent, k_pe, norm_weight, eps, positions, freq, scaling, interleaved, cache, table, slots,
            lens, scale):
    """The reference decode step: (out [B, N, R] float32, the cache with each row's new entry at lens - 1)."""
    R = q_abs.shape[-1]
    bs = cache.shape[1]
    lat = latent.float()
    c_new = lat * torch.rsqrt(lat.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    new = torch.cat((c_new, ref_mla_rotate(k_pe.float(), positions, freq, scaling, interleaved)), -1)
    cache = cache.clone()
    flat = cache.flatten(0, 1)
    for b, (slot, n) in enumerate(zip(slots, lens)):
        flat[flat_rows(table, slot, torch.tensor(n - 1), bs)] = new[b].to(cache.dtype)
    q = ref_mla_query(q_abs, q_pe, positions, freq, scaling, interleaved)
    return ref_mla_attend(q, cache.float(), table, slots, lens, scale, R), cache


def ref_mla_query(q_abs, q_pe, positions, freq, scaling, interleaved):
    """The reference's queries [B, N, R + P] float32: q_abs beside the rotated q_pe."""
    return torch.cat((q_abs.float(), ref_mla_rotate(q_pe.float(), positions, freq, scaling, interleaved)), -1)


def ref_mla_attend(q, cache, table, slots, lens, scale, R):
    """q [B, N, R + P] float32 over each row's positions 0 .. lens[b] - 1 of cache [NB, BS, R + P] float32 (scores
    over [c, k_pe], weights over c) -> [B, N, R]."""
    bs, flat = cache.shape[1], cache.flatten(0, 1)
    out = []
    for b, (slot, n) in enumerate(zip(slots, lens)):
        keys = flat[flat_rows(table, slot, torch.arange(n, device=cache.device), bs)]  # [n, R + P]
        out.append((q[b] @ keys.T * scale).softmax(-1) @ keys[:, :R])
    return torch.stack(out)


def mla_cases():
    """(lens, max_len, bs, (N, R, P)): block edges in one chunk, then three chunks (the new token in each), on
    the interpreter; 1 to 128K keys on the GPU (16 and 128 heads)."""
    cases = []
    for bs in (16, 64):
        cases.append(([1, bs - 1, bs, bs + 1, 100], 128, bs, (20, 64, 32)))
        cases.append(([1, 255, 257, 700, bs + 1], 768, bs, (20, 64, 32)))
        cases += [pytest.param([n, n // 3 + 1, 1], n, bs, (heads, 512, 64), marks=cuda_only,
                               id=f"{n}keys-{heads}heads-bs{bs}") for n in KEYS for heads in (16, 128)]
    return cases


def mla_step(lens, bs, shape, dtype, g):
    """A decode step's inputs over a shuffled paged latent cache filled before each row's new token."""
    N, R, P = shape
    B = len(lens)
    slots, slots_t, lens_t, table, num_blocks = rows_setup(lens, bs, g)
    cache = filled_cache((num_blocks, bs, R + P), table, slots, [n - 1 for n in lens], dtype, g)
    q_abs = grouped(B, 1, N, R, g).to(DEVICE, dtype)
    q_pe = torch.randn(B, N, P, generator=g).to(DEVICE, dtype)
    latent = torch.randn(B, R, generator=g).to(DEVICE, dtype)
    k_pe = torch.randn(B, P, generator=g).to(DEVICE, dtype)
    norm_weight = (1 + 0.1 * torch.randn(R, generator=g)).to(DEVICE, dtype)
    scale = (R + P) ** -0.5
    for b, (slot, n) in enumerate(zip(slots, lens)):
        rows = needle_rows(table, slot, 0, n - 1, bs, g)
        plant_needles(cache.flatten(0, 1)[:, :R], q_abs[b].float(), rows, n, scale)
    args = (q_abs, q_pe, latent, k_pe, norm_weight, 1e-6, lens_t - 1, inv_freq(P), 0.9)
    return slots, slots_t, lens_t, table, cache, args, scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("lens,max_len,bs,shape", mla_cases())
def test_mla_decode_writes_the_new_row_and_reads_the_blocks(lens, max_len, bs, shape, interleaved, dtype):
    g = torch.Generator().manual_seed(len(lens) * bs + max_len)
    slots, slots_t, lens_t, table, cache, args, scale = mla_step(lens, bs, shape, dtype, g)
    heads = -(-shape[0] // 16)  # the kernel's head blocks
    assert (chunk_len(max_len, len(lens) * heads) < max_len) == (max_len > MIN_CHUNK)  # long caches: chunks
    want, want_cache = ref_mla(*args, interleaved, cache, table, slots, lens, scale)
    cache0 = cache.clone()
    got = triton_mla_decode(*args, interleaved, cache, table, slots_t, lens_t, scale, max_len)
    assert got.shape == (len(lens), shape[0], shape[1]) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, **TOL[dtype])
    new_rows = torch.stack([flat_rows(table, s, torch.tensor(n - 1), bs) for s, n in zip(slots, lens)])
    torch.testing.assert_close(cache.flatten(0, 1)[new_rows], want_cache.flatten(0, 1)[new_rows], **TOL[dtype])
    unchanged_but(cache, cache0, new_rows)


def fp8_mla_cases():
    """(lens, max_len, bs, (N, R, P)) on a float8 cache: block edges in one chunk at two block sizes, three chunks."""
    return [([1, 15, 16, 17, 100], 128, 16, (20, 64, 32)), ([1, 63, 64, 65], 128, 64, (16, 64, 32)),
            ([1, 255, 257, 700, 17], 768, 16, (20, 64, 32)),
            pytest.param([32768, 1000, 1], 32768, 64, (128, 512, 64), marks=cuda_only, id="32768keys-fp8")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,max_len,bs,shape", fp8_mla_cases())
def test_mla_decode_writes_and_reads_a_fp8_cache(lens, max_len, bs, shape, dtype):
    """The new rows written as quantize_rows writes the unquantized kernel's (bit for bit), nothing else changed;
    the output equals the float32 reference over the dequantized cache, the new rows included."""
    g = torch.Generator().manual_seed(len(lens) * bs + max_len)
    slots, slots_t, lens_t, table, cache, args, scale = mla_step(lens, bs, shape, dtype, g)
    cache8, scales = quantize_rows(cache)
    cache0, scales0 = cache8.clone(), scales.clone()
    plain = dequantized(cache8, scales).to(dtype)
    triton_mla_decode(*args, True, plain, table, slots_t, lens_t, scale, max_len)  # its new rows
    got = triton_mla_decode(*args, True, cache8, table, slots_t, lens_t, scale, max_len, scales)
    assert got.shape == (len(lens), shape[0], shape[1]) and got.dtype == dtype
    new_rows = torch.stack([flat_rows(table, s, torch.tensor(n - 1), bs) for s, n in zip(slots, lens)])
    assert_quantized_rows(cache8, scales, plain, new_rows)
    same_codes(cache8, cache0, new_rows)
    unchanged_but(scales, scales0, new_rows)
    q = ref_mla_query(args[0], args[1], args[6], args[7], args[8], True)
    want = ref_mla_attend(q, dequantized(cache8, scales), table, slots, lens, scale, shape[1])
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


def test_kernels_refuse_caches_they_cannot_address():
    """A block size outside 16..256 or not a power of two, a cache not contiguous, a block table not int32."""
    q = torch.zeros(1, 4, 16, device=DEVICE)
    one = torch.ones(1, dtype=torch.long, device=DEVICE)
    table = torch.ones(1, 2, dtype=torch.int32, device=DEVICE)
    for bs in (8, 48, 512):
        k = torch.zeros(3, bs, 2, 16, device=DEVICE)
        with pytest.raises(ValueError, match="block size"):
            triton_decode_attention(q, k, k, table, one, one, 0.25, None, 1)
    k = torch.zeros(3, 2, 32, 16, device=DEVICE).transpose(1, 2)
    with pytest.raises(ValueError, match="contiguous"):
        triton_decode_attention(q, k, k, table, one, one, 0.25, None, 1)
    k = torch.zeros(3, 32, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="int32"):
        triton_decode_attention(q, k, k, table.long(), one, one, 0.25, None, 1)


def graph_gqa(lens, g, fp8=False):
    """A decode step of triton_decode_attention at the graph test's fixed shapes: (inputs, reference); fp8: over
    a float8 cache, its scales last in the inputs."""
    bs, max_len, dtype = 64, 4096, torch.bfloat16
    slots, slots_t, lens_t, table, _ = rows_setup(lens, bs, g)
    table_full = torch.zeros(table.shape[0], max_len // bs + 1, dtype=torch.int32, device=DEVICE)
    table_full[:, :table.shape[1]] = table
    k, v = (filled_cache((3 * max_len // bs + 3, bs, 4, 128), table_full, slots, lens, dtype, g) for _ in range(2))
    q = grouped(len(lens), 4, 8, 128, g).to(DEVICE, dtype)
    plant_group_needles(k, q.float(), table_full, slots, lens, None, 0, g)
    inputs = [q, k, v, table_full, slots_t, lens_t]
    if fp8:
        (k8, ks), (v8, vs) = quantize_rows(k), quantize_rows(v)
        inputs, k, v = [q, k8, v8, table_full, slots_t, lens_t, ks, vs], dequantized(k8, ks), dequantized(v8, vs)
    return inputs, (ref_attention(q, k, v, table_full, slots, lens, 128 ** -0.5, None), None)


def graph_mla(lens, g):
    """A decode step of triton_mla_decode at the graph test's fixed shapes: (inputs, (reference, its cache))."""
    bs, max_len, dtype = 64, 4096, torch.bfloat16
    slots, slots_t, lens_t, table, cache, args, scale = mla_step(lens, bs, (16, 512, 64), dtype, g)
    table_full = torch.zeros(table.shape[0], max_len // bs + 1, dtype=torch.int32, device=DEVICE)
    table_full[:, :table.shape[1]] = table
    cache_full = torch.full((3 * max_len // bs + 3, bs, 576), float("nan"), dtype=dtype, device=DEVICE)
    cache_full[:cache.shape[0]] = cache
    return [*args, cache_full, table_full, slots_t, lens_t], ref_mla(*args, True, cache_full, table_full, slots,
                                                                     lens, scale)


@cuda_only
@pytest.mark.parametrize("kind", ["gqa", "gqa-fp8", "mla"])
def test_replayed_graph_follows_lens_and_block_table_rewritten_in_place(kind):
    """One capture at a fixed padded length (4096), replayed with new lengths, block tables and caches copied
    into the captured tensors (a float8 cache's scales too): each replay equals the reference of its inputs
    (MLA: its cache too)."""
    g = torch.Generator().manual_seed(0)
    step = {"gqa": graph_gqa, "gqa-fp8": functools.partial(graph_gqa, fp8=True), "mla": graph_mla}[kind]
    captured, _ = step([4096, 700, 1], g)
    if kind != "mla":
        def call():
            return triton_decode_attention(*captured[:6], 128 ** -0.5, None, 4096, *captured[6:])
    else:
        def call():
            return triton_mla_decode(*captured[:9], True, *captured[9:], 576 ** -0.5, 4096)
    call()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for lens in ([4096, 700, 1], [65, 4000, 2049], [1, 1, 3000]):
        inputs, (want, want_cache) = step(lens, g)
        for dst, src in zip(captured, inputs):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
        graph.replay()
        torch.testing.assert_close(out.float(), want, **TOL[torch.bfloat16])
        if want_cache is not None:
            torch.testing.assert_close(captured[9], want_cache, **TOL[torch.bfloat16], equal_nan=True)
