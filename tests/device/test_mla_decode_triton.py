"""Multi-head latent attention's fused decode kernel (layers/mla_decode_triton.py, fused_layer on) against
the module's torch path: the same outputs and latent caches after a fixed-shape decode step. Interleaved
rotary pairs (DeepSeek's checkpoints) and halves, with and without q_lora, heads not a multiple of the
kernel's block, rows of length 1 and long ones (past one chunk of the kernel's positions too), paged
through a shuffled block table; float32 and bfloat16. Runs on the GPU host.

B rows, N heads, R kv_lora_rank, P qk_rope_head_dim, S slots, NB blocks of BS positions, M blocks per slot.
"""

import pytest
import torch

from hybridmoe.forward_context import Context, DecodeBatch, use_context
from hybridmoe.layers.mla import MultiHeadLatentAttention

pytestmark = [pytest.mark.device,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
BS = 64


def mla(heads: int, q_lora: int | None, interleave: bool, dtype: torch.dtype, table: torch.Tensor):
    """The module on CUDA with a cache of the table's blocks and block 0 (scratch), filled at random."""
    torch.manual_seed(0)
    a = MultiHeadLatentAttention(256, heads, q_lora, 512, 64, 64, 64,
                                 {"rope_type": "default", "rope_theta": 1e4}, interleave).to("cuda", dtype)
    with torch.no_grad():
        for p in a.parameters():
            p.normal_(0, 0.05)
        a.kv_a_layernorm.weight.add_(1.0)
    a.allocate_kv_cache(table.numel() + 1, BS)
    with torch.no_grad():  # rows already cached up to their new token
        a.kv_cache.normal_()
    return a


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,q_lora,interleave", [(16, None, True), (20, 96, True), (16, None, False)])
@pytest.mark.parametrize("lens,pad_len", [([1, 1], 256), ([7, 200, 33], 256), ([3000, 5, 1500], 4096)])
def test_fused_mla_decode_equals_the_torch_path(lens, pad_len, heads, q_lora, interleave, dtype):
    per_slot = pad_len // BS
    order = torch.randperm(4 * per_slot, generator=torch.Generator().manual_seed(pad_len)) + 1  # block 0: scratch
    table = order.view(4, per_slot).to("cuda", torch.int32)
    a = mla(heads, q_lora, interleave, dtype, table)
    B = len(lens)
    x = torch.randn(B, 256, generator=torch.Generator().manual_seed(B)).to("cuda", dtype)
    ctx = Context(slot_ids=[], start_pos=[], cu_seqlens=[0], decode=DecodeBatch(
        torch.tensor([3, 0, 2][:B], device="cuda"), torch.tensor(lens, device="cuda"), pad_len), block_table=table)
    positions = torch.tensor(lens, device="cuda") - 1
    cache = a.kv_cache.clone()
    outs = []
    for fused in (True, False):
        a.kv_cache.copy_(cache)
        a.fused_layer = fused
        with use_context(ctx):
            outs.append((a(x, positions), a.kv_cache.clone()))
    (got, got_cache), (want, want_cache) = outs
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(got_cache, want_cache, **TOL[dtype])
