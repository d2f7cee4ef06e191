"""The decode step's fused Triton kernels on CUDA against the torch ops they replace: RMSNorm with and
without its residual add, the router's softmax top-k, the hybrid split of a step's slots (alone and
after the top-k in one kernel) and the sum of its two partial outputs (eagerly and as a CUDA graph replay, alone and in a hybrid layer, gpt-oss's experts with biases and the clamped SwiGLU too); attention's q/k norms, rotary and
cache writes, and decode attention; then a model decoding with them against the same model with them off. Runs on the GPU host through scripts/device_check.sh.

T tokens, E experts, K experts per token, H hidden, D normalized size.
"""

import pytest
import torch
import torch.nn.functional as F
from test_cuda_graph import HYBRID, assert_close_to, runs
from test_decode_attention_rope import seeded_attention

from hybridmoe import LLM
from hybridmoe.checkpoint.make import make_checkpoint
from hybridmoe.experts.cpu_experts import CpuExperts
from hybridmoe.experts.decode_fused import (
    add_parts,
    route_split,
    split_slots,
    sum_parts,
)
from hybridmoe.experts.hybrid import HybridExperts
from hybridmoe.experts.placement import Footprint, PlacementPlan
from hybridmoe.experts.torch_ref import TorchExperts
from hybridmoe.forward_context import Context, DecodeBatch, use_context
from hybridmoe.layers.attention import contiguous_slot_table
from hybridmoe.layers.clamped_swiglu import ClampedSwiGLU
from hybridmoe.layers.norm import RMSNorm
from hybridmoe.layers.router import softmax_topk

pytestmark = [pytest.mark.device,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


def norm(D: int, dtype: torch.dtype, fused: bool) -> RMSNorm:
    n = RMSNorm(D, 1e-6).cuda()
    with torch.no_grad():
        n.weight.copy_(1 + 0.1 * torch.randn(D, generator=torch.Generator().manual_seed(D)))
    n.to(dtype).fused = fused
    return n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 4, 300])
def test_rms_norm_and_its_residual_add_equal_torch(T, dtype):
    g = torch.Generator().manual_seed(T)
    x, res = (torch.randn(T, 2048, generator=g).to("cuda", dtype) for _ in range(2))
    fused, ref = norm(2048, dtype, True), norm(2048, dtype, False)
    torch.testing.assert_close(fused(x), ref(x), **TOL[dtype])
    (out, total), (want, want_total) = fused(x, residual=res), ref(x, residual=res)
    assert torch.equal(total, want_total)  # one float32 add, rounded once, either way
    torch.testing.assert_close(out, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_of_head_views_into_a_merged_projection(dtype):
    # q [T, Hq, D] and k [T, Hkv, D] as Attention makes them: views into qkv [T, (Hq + 2 Hkv) D]
    T, Hq, Hkv, D = 3, 32, 4, 128
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=torch.Generator().manual_seed(0)).to("cuda", dtype)
    q, k, _ = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    fused, ref = norm(D, dtype, True), norm(D, dtype, False)
    for heads in (q.view(T, Hq, D), k.view(T, Hkv, D)):
        torch.testing.assert_close(fused(heads), ref(heads), **TOL[dtype])


@pytest.mark.parametrize("E,K,renormalize", [(8, 2, True), (60, 4, False), (128, 8, True)])
@pytest.mark.parametrize("T", [1, 4, 9])
def test_softmax_topk_kernel_picks_torchs_experts_and_weights(T, E, K, renormalize):
    """bfloat16 logits tie often (128 experts, 8 mantissa bits). Tied experts may come in another order
    than torch.topk's (which leaves it unspecified), and at the K-th place either may be picked;
    everything else is the same: each token's experts, their weights, largest first."""
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(E + T)).to("cuda", torch.bfloat16)
    w, ids = softmax_topk(logits, K, renormalize, fused=True)
    want_w, want_ids = softmax_topk(logits, K, renormalize, fused=False)
    assert bool((w[:, :-1] >= w[:, 1:]).all())
    torch.testing.assert_close(w, want_w, atol=1e-6, rtol=1e-5)
    probs = torch.softmax(logits.float(), dim=-1)
    picked = torch.zeros(T, E, dtype=torch.bool, device="cuda").scatter_(1, ids, True)
    want = torch.zeros_like(picked).scatter_(1, want_ids, True)
    kth = probs.gather(1, want_ids[:, -1:])  # [T, 1] the K-th largest probability
    assert bool(((picked == want) | (probs == kth)).all())
    mine = torch.zeros(T, E, device="cuda").scatter_(1, ids, w)
    theirs = torch.zeros(T, E, device="cuda").scatter_(1, want_ids, want_w)
    both = picked & want
    torch.testing.assert_close(mine[both], theirs[both], atol=1e-6, rtol=1e-5)


def placement(E: int, on: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """on_gpu [E] bool with `on` experts set, local [E]: each expert's index among its side's."""
    g = torch.Generator().manual_seed(seed)
    on_gpu = torch.zeros(E, dtype=torch.bool)
    on_gpu[torch.randperm(E, generator=g)[:on]] = True
    local = torch.empty(E, dtype=torch.long)
    for side in (on_gpu, ~on_gpu):
        local[side] = torch.arange(int(side.sum()))
    return on_gpu.cuda(), local.cuda()


def routing(T: int, E: int, K: int, on_gpu: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    gpu = on_gpu.nonzero().flatten().cpu()
    if T > 1 and len(gpu) >= K:
        ids[1] = gpu[:K]  # a token whose experts are all on the GPU (its CPU slots are all padding)
    return ids.cuda(), torch.rand(T, K, generator=g).cuda()


def assert_split_equal(got, want) -> None:
    (gid, gmask, gcid, gcw), (wid, wmask, wcid, wcw) = got, want
    assert torch.equal(gmask, wmask)
    assert torch.equal(gid[wmask].long(), wid[wmask])  # elsewhere: anything
    if wcid is None:
        assert gcid is None and gcw is None
    else:
        assert torch.equal(gcid, wcid) and torch.equal(gcw, wcw)


@pytest.mark.parametrize("E,K,on", [(8, 3, 0), (8, 3, 3), (8, 3, 6), (8, 3, 8), (128, 8, 26)])
@pytest.mark.parametrize("T", [1, 4, 9])
def test_split_slots_kernel_equals_torch(T, E, K, on):
    on_gpu, local = placement(E, on, seed=E + on)
    ids, w = routing(T, E, K, on_gpu, seed=T)
    width = min(K, E - on)
    assert_split_equal(split_slots(ids, w, on_gpu, local, width, fused=True),
                       split_slots(ids, w, on_gpu, local, width, fused=False))


@pytest.mark.parametrize("E,K,on,renormalize", [(8, 2, 3, True), (128, 8, 26, True), (60, 4, 60, False)])
@pytest.mark.parametrize("T", [1, 4, 9])
def test_route_split_kernel_equals_torch(T, E, K, on, renormalize):
    """The router's top-k and the split in one kernel (float32 logits: no ties, so the order is torch's)."""
    on_gpu, local = placement(E, on, seed=E + on)
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(T)).cuda()
    width = min(K, E - on)
    w, ids, split = route_split(logits, K, renormalize, on_gpu, local, width, fused=True)
    want_w, want_ids, _want_split = route_split(logits, K, renormalize, on_gpu, local, width, fused=False)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w, atol=1e-6, rtol=1e-5)
    assert_split_equal(split, split_slots(ids, w, on_gpu, local, width, fused=False))


@pytest.mark.parametrize("E,K,on,deferred", [(8, 3, 3, 1), (8, 3, 0, 2), (128, 8, 26, 2), (128, 8, 128, 1),
                                              (128, 8, 26, 3)])
@pytest.mark.parametrize("T", [1, 4, 9])
def test_route_split_and_split_slots_of_a_part_with_deferral_equal_torch(T, E, K, on, deferred):
    """The own part's split from the router's kernel (the first K - deferred columns), the deferred part's
    from the split kernel (the last deferred columns)."""
    on_gpu, local = placement(E, on, seed=E + on)
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(T)).cuda()
    width, later_width = min(K - deferred, E - on), min(deferred, E - on)
    w, ids, split = route_split(logits, K, True, on_gpu, local, width, True, deferred)
    want_w, want_ids, _ = route_split(logits, K, True, on_gpu, local, width, False, deferred)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w, atol=1e-6, rtol=1e-5)  # the kernel's exp is not torch's to the last bit
    # the splits, of the kernel's own top-k, exactly as torch splits it
    assert_split_equal(split, split_slots(ids, w, on_gpu, local, width, fused=False, part=(0, K - deferred)))
    part = (K - deferred, K)
    assert_split_equal(split_slots(ids, w, on_gpu, local, later_width, fused=True, part=part),
                       split_slots(ids, w, on_gpu, local, later_width, fused=False, part=part))


@pytest.mark.parametrize("E,K,on,deferred", [(8, 3, 3, 1), (8, 3, 0, 2), (128, 8, 26, 2), (128, 8, 120, 3)])
@pytest.mark.parametrize("T", [1, 4, 9])
def test_route_split_with_the_deferred_part_staged_equals_torch(T, E, K, on, deferred):
    """Both parts' splits from the router's kernel (later: the linked handoffs of CudaHandoff.link_deferred),
    each part's CPU slots in its own staging buffers, x staged once."""
    on_gpu, local = placement(E, on, seed=E + on)
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(T)).cuda()
    x = torch.randn(T, 64, generator=torch.Generator().manual_seed(T + 1)).to("cuda", torch.bfloat16)
    width, later_width = min(K - deferred, E - on), min(deferred, E - on)
    if not width or not later_width:
        pytest.skip("a part with no CPU slots is not staged")
    results = []
    for fused in (True, False):
        bufs = (torch.zeros(T, 64, device="cuda"), torch.zeros(T, width, dtype=torch.int64, device="cuda"),
                torch.zeros(T, width, device="cuda"), torch.zeros(T, later_width, dtype=torch.int64, device="cuda"),
                torch.zeros(T, later_width, device="cuda"))
        w, ids, split, split2 = route_split(logits, K, True, on_gpu, local, width, fused, deferred, (x, *bufs[:3]),
                                            later=(later_width, bufs[3], bufs[4], None))
        assert split2[2] is bufs[3] and split2[3] is bufs[4]
        results.append((w, ids, split, split2, bufs))
    (w, ids, split, split2, bufs), (want_w, want_ids, _, _, _want_bufs) = results
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w, atol=1e-6, rtol=1e-5)
    assert_split_equal(split, split_slots(ids, w, on_gpu, local, width, fused=False, part=(0, K - deferred)))
    assert_split_equal(split2, split_slots(ids, w, on_gpu, local, later_width, fused=False, part=(K - deferred, K)))
    assert torch.equal(bufs[0], x.float())


def test_sum_parts_kernel_equals_torch():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(4, 2048, generator=g).to("cuda", torch.bfloat16)
    b, c, d = (torch.randn(4, 2048, generator=g).cuda() for _ in range(3))
    for dtype in (torch.bfloat16, torch.float32):
        for parts in ([a, b], [a, b, c], [a, b, c, d]):
            assert torch.equal(sum_parts(parts, dtype, fused=True), sum_parts(parts, dtype, fused=False))


def test_add_parts_kernel_equals_torch():
    g = torch.Generator().manual_seed(4)
    a = torch.randn(4, 2048, generator=g).to("cuda", torch.bfloat16)
    b = torch.randn(4, 2048, generator=g).cuda() * 3
    for dtype in (torch.bfloat16, torch.float32):
        h = torch.randn(4, 2048, generator=g).to("cuda", dtype) * 50
        for parts in ([a, b], [b], [a]):
            assert torch.equal(add_parts(h, parts, fused=True), add_parts(h, parts, fused=False))


def test_fused_kernels_replayed_in_a_graph_equal_eager():
    T, E, K, H = 4, 128, 8, 2048
    on_gpu, local = placement(E, 26, seed=1)
    n = norm(H, torch.bfloat16, True)
    gate = torch.randn(E, H, generator=torch.Generator().manual_seed(2)).to("cuda", torch.bfloat16) / H ** 0.5
    x = torch.zeros(T, H, dtype=torch.bfloat16, device="cuda")
    res = torch.zeros_like(x)
    cpu_out = torch.zeros_like(x)

    def step():
        h, total = n(x, residual=res)
        w, ids = softmax_topk(h @ gate.t(), K, True)
        gid, mask, cid, cw = split_slots(ids, w, on_gpu, local, K)
        return total, ids, w, gid, mask, cid, cw, sum_parts([cpu_out, h.float()], torch.bfloat16)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = step()
    g = torch.Generator().manual_seed(3)
    for t in (x, res, cpu_out):
        t.copy_(torch.randn(T, H, generator=g))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(replayed, step()):
        assert torch.equal(got, want)


GLU = ClampedSwiGLU(alpha=1.702, limit=1.0)
"""gpt-oss's activation with a limit the layer's gate and up sums pass."""


def hybrid_layer(seed: int = 0):
    """One layer's experts (gate, up [8, 32, 64], down [8, 64, 32]) and gpt-oss biases (gate, up [8, 32], down [8, 64])."""
    g = torch.Generator().manual_seed(seed)
    weights = (torch.randn(8, 32, 64, generator=g) / 8, torch.randn(8, 32, 64, generator=g) / 8,
               torch.randn(8, 64, 32, generator=g) / 6)
    return weights, (torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g), torch.randn(8, 64, generator=g))


def hybrid_backend(gpu_ids: list[int], fused: bool, gpt_oss: bool = False) -> HybridExperts:
    """hybrid_layer's experts split with gpu_ids on the GPU, the others in a native bf16 engine; gpt_oss: with the
    biases and the clamped SwiGLU on both sides."""
    E, H, I, K = 8, 64, 32, 3
    fp = Footprint(0, 0, 0, 3 * I * H * 4, [0], E, K, H, I)

    def cpu_layer(gate, up, down):
        experts = CpuExperts(gate, up, down, format="bf16", threads=2)
        experts.set_glu(GLU if gpt_oss else None)
        return experts

    b = HybridExperts(PlacementPlan(fp, None, "test", {0: gpu_ids} if gpu_ids else {}), "cuda", cpu_layer,
                      GLU if gpt_oss else F.silu, num_layers=1)
    weights, biases = hybrid_layer()
    b.set_layer(0, *weights)
    if gpt_oss:
        b.set_layer_biases(0, *biases)
    b.fused = fused
    return b


@pytest.mark.parametrize("gpt_oss", [False, True], ids=["silu", "gpt-oss"])
@pytest.mark.parametrize("gpu_ids", [[], [0, 3, 5], [0, 1, 2, 3, 4, 5], list(range(8))])
@pytest.mark.parametrize("T", [1, 6])
def test_hybrid_layer_with_fused_glue_equals_the_synchronous_path_eager_and_replayed(T, gpu_ids, gpt_oss):
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, 64, generator=g).cuda()
    w, ids = torch.randn(T, 8, generator=g).softmax(-1).topk(3, dim=-1)
    ids, w = ids.cuda(), w.cuda()
    want = hybrid_backend(gpu_ids, False, gpt_oss).forward(0, x, ids, w)
    if gpt_oss:  # the float32 torch reference, within the CPU engine's bf16
        ref = TorchExperts(glu=GLU)
        weights, biases = hybrid_layer()
        ref.set_layer(0, *weights)
        ref.set_layer_biases(0, *biases)
        torch.testing.assert_close(want.cpu(), ref.forward(0, x.cpu(), ids.cpu(), w.cpu()), **TOL[torch.bfloat16])
    fixed = hybrid_backend(gpu_ids, True, gpt_oss)
    assert fixed.use_fixed_shapes(8, torch.float32)
    torch.testing.assert_close(fixed.forward(0, x, ids, w), want, atol=1e-4, rtol=1e-4)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fixed.forward(0, x, ids, w)
    graph.replay()
    torch.cuda.synchronize()
    fixed.check()
    torch.testing.assert_close(replayed, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm,window", [(True, None), (False, None), (True, 3)])
def test_attention_fused_equals_torch(qk_norm, window, dtype):
    """A prefill of two sequences, then a fixed-shape decode step (norms, rotary and cache writes in one
    kernel, the decode step's attention in another): the same outputs and caches."""
    torch.manual_seed(0)
    layers = []
    for fused in (True, False):
        a = seeded_attention(256, 64, qk_norm, window, dtype)
        a.allocate_kv_cache(3, 64, contiguous_slot_table(3, 64, 64, torch.device("cuda")))  # a block per slot
        a.fused, a.fused_layer = fused, False  # the layer fusions against these: test_decode_attention_rope.py
        layers.append(a)
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(1)).to("cuda", dtype)
    prefill = Context(slot_ids=[2, 0], start_pos=[0, 0], cu_seqlens=[0, 4, 7])
    decode = Context(slot_ids=[], start_pos=[], cu_seqlens=[0], decode=DecodeBatch(
        torch.tensor([2, 0], device="cuda"), torch.tensor([5, 4], device="cuda"), 64))
    outs = []
    for a in layers:
        with use_context(prefill):
            p = a(x, torch.tensor([0, 1, 2, 3, 0, 1, 2], device="cuda"))
        with use_context(decode):
            d = a(x[:2], torch.tensor([4, 3], device="cuda"))
        outs.append((p, d, a.kv_cache.k, a.kv_cache.v))
    for got, want in zip(*outs):
        torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 300])
def test_decode_attention_over_a_long_cache_in_chunks_equals_torch(window, dtype):
    """Caches longer than one chunk, paged through a shuffled block table: chunks side by side, then combined
    (some chunks see no key), against SDPA over each row's keys gathered through the table."""
    from hybridmoe.layers.decode_attention_triton import (
        triton_decode_attention,  # triton: on the GPU host only
    )

    g = torch.Generator().manual_seed(0)
    S, L, BS, Hq, Hkv, D = 3, 2048, 64, 32, 4, 128
    table = (torch.randperm(S * L // BS, generator=g) + 1).view(S, L // BS).to("cuda", torch.int32)  # 0: scratch
    k, v = (torch.randn(S * L // BS + 1, BS, Hkv, D, generator=g).to("cuda", dtype) for _ in range(2))
    q = torch.randn(2, Hq, D, generator=g).to("cuda", dtype)
    slots, lens = torch.tensor([2, 0], device="cuda"), torch.tensor([1500, 700], device="cuda")
    rows = (table[slots].long()[:, :, None] * BS + torch.arange(BS, device="cuda")).flatten(1)  # [B, L] in order
    kb, vb = (c.flatten(0, 1)[rows].transpose(1, 2) for c in (k, v))  # [B, Hkv, L, D]
    pos = torch.arange(L, device="cuda")
    mask = pos[None, :] < lens[:, None]
    if window is not None:
        mask &= pos[None, :] >= lens[:, None] - window
    want = F.scaled_dot_product_attention(q.unsqueeze(2), kb, vb, attn_mask=mask[:, None, None, :], scale=D ** -0.5,
                                          enable_gqa=True).squeeze(2)
    got = triton_decode_attention(q, k, v, table, slots, lens, D ** -0.5, window, L)
    torch.testing.assert_close(got, want, **TOL[dtype])


def decoder(checkpoint, fused: bool) -> LLM:
    llm = LLM(checkpoint, device="cuda", **HYBRID)
    llm.engine.runner.model.fuse_decode_kernels(fused)
    return llm


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_model_decodes_with_fused_kernels_as_without(tmp_path, dtype):
    """Graph-replayed decoding, batch 1 and 4, with every fusion (the layer fusions included): decoding the
    greedy tokens of the model without them, its logprobs step by step (logprobs_close.py)."""
    make_checkpoint("qwen3_moe", "tiny", tmp_path, dtype=dtype, seed=1, progress=False)
    reference, fused = decoder(tmp_path, False), decoder(tmp_path, True)
    assert_close_to(fused, reference, runs(reference))
    assert fused.engine.runner.captured == reference.engine.runner.captured == [(1, 64), (4, 64)]
