"""Multi-head latent attention's fused decode kernel (layers/mla_decode_triton.py, fused_layer on) against
the module's torch path: the same outputs and latent caches after a fixed-shape decode step. Interleaved
rotary pairs (DeepSeek's checkpoints) and halves, with and without q_lora, heads not a multiple of the
kernel's block, rows of length 1 and long ones (past one chunk of the kernel's positions too), paged
through a shuffled block table; float32 and bfloat16; the cache in the model's dtype or in float8 with a
scale per position (layers/kv_quant.py). The module's own fused path runs on the GPU host; the kernel on a
float8 cache, called with the module's tensors as the module calls it, runs there and, small, on the CPU
under Triton's interpreter (TRITON_INTERPRET=1, triton installed).

B rows, N heads, R kv_lora_rank, P qk_rope_head_dim, S slots, NB blocks of BS positions, M blocks per slot.
"""

import pytest
import torch

# the same folder's kernel tests: their DEVICE (they skip this module too where neither CUDA nor the
# interpreter runs, so triton is there below) and their fixes to the interpreter, autouse here as there
from test_paged_attention_kernels import (  # noqa: F401
    DEVICE,
    _interpreter_dots_take_bfloat16_values,
    _interpreter_rounds_to_float8_to_nearest_even,
)

from hybridmoe.forward_context import Context, DecodeBatch, use_context
from hybridmoe.layers.kv_quant import quantize_rows
from hybridmoe.layers.mla import MultiHeadLatentAttention, apply_rotary_interleaved
from hybridmoe.layers.mla_decode_triton import triton_mla_decode

pytestmark = pytest.mark.device
cuda_only = pytest.mark.skipif(DEVICE != "cuda", reason="the module's fused path: on the GPU only")

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
E4M3_STEP = 2 ** -3
"""One e4m3 step relative to the value below it: where the two paths' rows in the model's dtype differ (float32
rsqrt, cos and sin by an ulp), their codes can round a step apart."""
BS = 64


def mla(heads: int, q_lora: int | None, interleave: bool, dtype: torch.dtype, table: torch.Tensor,
        quantized: bool = False, dims: tuple[int, int, int, int, int] = (256, 512, 64, 64, 64), bs: int = BS):
    """The module on DEVICE (dims: hidden, R, nope, P, v head dims) with a cache of the table's blocks and block 0
    (scratch), filled at random: float8 codes and their scales when quantized."""
    hidden, R, nope, P, v = dims
    torch.manual_seed(0)
    a = MultiHeadLatentAttention(hidden, heads, q_lora, R, nope, P, v,
                                 {"rope_type": "default", "rope_theta": 1e4}, interleave).to(DEVICE, dtype)
    with torch.no_grad():
        for p in a.parameters():
            p.normal_(0, 0.05)
        a.kv_a_layernorm.weight.add_(1.0)
    a.allocate_kv_cache(table.numel() + 1, bs, quantized=quantized)
    with torch.no_grad():  # rows already cached up to their new token
        if quantized:
            codes, scales = quantize_rows(torch.randn(a.kv_cache.shape, device=DEVICE))
            a.kv_cache.copy_(codes)
            a.kv_scale.copy_(scales)
        else:
            a.kv_cache.normal_()
    return a


def shuffled_table(pad_len: int, bs: int = BS) -> torch.Tensor:
    """[4, pad_len / bs] int32: four slots' blocks in a shuffled order from 1 (block 0: scratch)."""
    per_slot = pad_len // bs
    order = torch.randperm(4 * per_slot, generator=torch.Generator().manual_seed(pad_len)) + 1
    return order.view(4, per_slot).to(DEVICE, torch.int32)


def decode_step(lens: list[int], pad_len: int, table: torch.Tensor) -> Context:
    return Context(slot_ids=[], start_pos=[], cu_seqlens=[0], decode=DecodeBatch(
        torch.tensor([3, 0, 2][:len(lens)], device=DEVICE), torch.tensor(lens, device=DEVICE), pad_len),
        block_table=table)


def torch_path(a: MultiHeadLatentAttention, x: torch.Tensor, ctx: Context) -> torch.Tensor:
    """The module's torch ops (fused_layer off): [B, H], its cache written."""
    a.fused_layer = False
    with use_context(ctx):
        return a(x, ctx.decode.lens - 1)


def kernel_path(a: MultiHeadLatentAttention, x: torch.Tensor, ctx: Context) -> torch.Tensor:
    """The module's fused decode step (mla.py _attention with fused_layer on), its projections in torch and the
    attention in triton_mla_decode with the module's cache: [B, H], its cache written."""
    B, N, R, D, P = x.shape[0], a.num_heads, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim
    q = a.q_proj(x) if hasattr(a, "q_proj") else a.q_b_proj(a.q_a_layernorm(a.q_a_proj(x)))
    q_nope, q_pe = q.view(B, N, -1).split([D, P], dim=-1)
    latent, k_pe = a.kv_a_proj_with_mqa(x).split([R, P], dim=-1)
    w_uk, w_uv = a.kv_b_proj.weight.view(N, D + a.v_head_dim, R).split([D, a.v_head_dim], dim=1)
    d, norm = ctx.decode, a.kv_a_layernorm
    out = triton_mla_decode(torch.einsum("tnd,ndr->tnr", q_nope, w_uk), q_pe, latent, k_pe, norm.weight, norm.eps,
                            d.lens - 1, a.rotary.inv_freq(x.device), a.rotary.attention_scaling,
                            a.rotate is apply_rotary_interleaved, a.kv_cache, ctx.block_table, d.slots, d.lens,
                            a.scale, d.pad_len, a.kv_scale)
    return a.o_proj(torch.einsum("tnr,nvr->tnv", out, w_uv).reshape(B, -1))


def assert_same_cache(got: tuple, want: tuple, dtype: torch.dtype) -> None:
    """Caches (latents, scales or None) equal: within TOL in the model's dtype; float8 ones with their scales
    within TOL's relative part and their dequantized values within TOL and a step more."""
    (got_c, got_s), (want_c, want_s) = got, want
    if got_s is None:
        torch.testing.assert_close(got_c, want_c, **TOL[dtype])
        return
    torch.testing.assert_close(got_s, want_s, rtol=TOL[dtype]["rtol"], atol=0)
    torch.testing.assert_close(got_c.float() * got_s, want_c.float() * want_s, atol=TOL[dtype]["atol"],
                               rtol=TOL[dtype]["rtol"] + E4M3_STEP)


def cache_state(a: MultiHeadLatentAttention) -> tuple:
    return a.kv_cache.clone(), None if a.kv_scale is None else a.kv_scale.clone()


def restore(a: MultiHeadLatentAttention, state: tuple) -> None:
    a.kv_cache.copy_(state[0])
    if state[1] is not None:
        a.kv_scale.copy_(state[1])


@cuda_only
@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,q_lora,interleave", [(16, None, True), (20, 96, True), (16, None, False)])
@pytest.mark.parametrize("lens,pad_len", [([1, 1], 256), ([7, 200, 33], 256), ([3000, 5, 1500], 4096)])
def test_fused_mla_decode_equals_the_torch_path(lens, pad_len, heads, q_lora, interleave, dtype, quantized):
    table = shuffled_table(pad_len)
    a = mla(heads, q_lora, interleave, dtype, table, quantized)
    x = torch.randn(len(lens), 256, generator=torch.Generator().manual_seed(len(lens))).to(DEVICE, dtype)
    ctx = decode_step(lens, pad_len, table)
    cache = cache_state(a)
    outs = []
    for fused in (True, False):
        restore(a, cache)
        a.fused_layer = fused
        with use_context(ctx):
            outs.append((a(x, ctx.decode.lens - 1), cache_state(a)))
    (got, got_cache), (want, want_cache) = outs
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert_same_cache(got_cache, want_cache, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs,interleave", [(16, True), (64, False)])
@pytest.mark.parametrize("lens,pad_len", [([1, 1], 64), ([7, 40, 17], 64), ([300, 5, 64], 512)])
def test_mla_kernel_over_a_fp8_cache_equals_the_torch_path(lens, pad_len, bs, interleave, dtype):
    """The kernel on a float8 cache against the module's torch ops on it (every cached row dequantized, in float32
    a float32 reference): 20 heads (a block and a part), rows at and across block edges, two chunks."""
    table = shuffled_table(pad_len, bs)
    a = mla(20, None, interleave, dtype, table, quantized=True, dims=(64, 64, 32, 32, 32), bs=bs)
    x = torch.randn(len(lens), 64, generator=torch.Generator().manual_seed(len(lens))).to(DEVICE, dtype)
    ctx = decode_step(lens, pad_len, table)
    cache = cache_state(a)
    with torch.no_grad():
        got = kernel_path(a, x, ctx)
        got_cache = cache_state(a)
        restore(a, cache)
        want = torch_path(a, x, ctx)
    torch.testing.assert_close(got, want, **TOL[dtype])
    assert_same_cache(got_cache, cache_state(a), dtype)
