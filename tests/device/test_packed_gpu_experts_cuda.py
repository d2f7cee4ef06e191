"""GPU experts kept packed (int4 / int8, experts/packed_gpu.py) in the Triton GPU share: equal to weighted_experts
on the same dequantized weights for T = 1 (decode: GEMV), 8 (expert-major), 9 and 300 (sorted blocks), eagerly
and as a CUDA graph replay; decode steps with K split equal the whole sums; the GEMV kernels equal the dot ones; the streamed prefill's resident experts; and a hybrid model on CUDA with int4
experts, whose GPU experts are packed, takes a quarter of bf16's expert memory and gives the tokens of
the same engine with every expert on the CPU. gpt-oss's experts (per-expert biases, the clamped SwiGLU) packed, through
the GEMV and the dot kernels and the streamed prefill's (its packed experts in chunks beside resident ones), against
the float32 reference; and a hybrid gpt-oss model on CUDA with its GPU experts packed against every expert on the CPU.
Runs on the GPU host through scripts/device_check.sh; the gpt-oss kernel cases in float32 also on the CPU under
Triton's interpreter (TRITON_INTERPRET=1, triton installed), calling the kernels directly.

T tokens, K slots per token, E experts on the GPU, H hidden, I intermediate (H, I not multiples of the
kernels' blocks; I not a multiple of the packed layout's 32-row blocks for int8).
"""

import gc

import pytest
import torch
import torch.nn.functional as F
from kernels_device import kernels_device

from hybridmoe import LLM, SamplingParams
from hybridmoe.checkpoint.make import make_checkpoint
from hybridmoe.experts.cpu_experts import CpuExperts
from hybridmoe.experts.gpu_experts import (
    fixed_shape_experts,
    gpu_share,
    weighted_experts,
)
from hybridmoe.experts.packed_gpu import PackedMatrix, pack_gpu_experts
from hybridmoe.layers.clamped_swiglu import ClampedSwiGLU

DEVICE = kernels_device()

pytestmark = pytest.mark.device
cuda_only = pytest.mark.skipif(DEVICE != "cuda", reason="gpu_share's dispatch, CUDA graphs, long steps, bfloat16 and "
                               "float16 dots and CUDA models: on the GPU only")

E, K = 10, 8
CASES = [("int4", 32, False, 224, 96), ("int4", 64, True, 192, 128), ("int4", 128, False, 256, 128),
         ("int8", 128, False, 200, 72)]
MAX_ERROR = 2e-2
"""bf16 / fp16: the largest difference over the largest output (both sides round h, each its own way)."""


def packed(fmt, group, zero_points, H, I, dtype):
    g = torch.Generator().manual_seed(H + I)
    weights = (torch.randn(E, I, H, generator=g) / 8, torch.randn(E, I, H, generator=g) / 8,
               torch.randn(E, H, I, generator=g) / 6)
    cpu = CpuExperts(*weights, format=fmt, group_size=group, zero_points=zero_points)
    return pack_gpu_experts(cpu, torch.device(DEVICE), dtype)


def routing(T: int, H: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(T + seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    ids = torch.randint(0, E, (T, K), generator=g)
    ids[:, 1] = ids[:, 0]  # repeats within a token
    weights, mask = torch.rand(T, K, generator=g), torch.rand(T, K, generator=g) < 0.6
    mask[:, 0] = True
    return [t.to(DEVICE) for t in (x, ids, weights, mask)]


def assert_near(got, want):
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert (got - want).abs().max().item() <= MAX_ERROR * want.abs().max().item()


@cuda_only
@pytest.mark.parametrize("fmt,group,zero_points,H,I", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T", [1, 8, 9, 300])
def test_packed_experts_equal_weighted_experts_on_their_dequantized_weights(fmt, group, zero_points, H, I, dtype, T):
    experts = packed(fmt, group, zero_points, H, I, dtype)
    x, ids, weights, mask = routing(T, H, dtype)
    dense = tuple(m.dense() for m in experts)
    assert_near(gpu_share(x, *experts, ids, weights, mask, F.silu), weighted_experts(x, *dense, ids, weights, mask,
                                                                                      F.silu))


@cuda_only
@pytest.mark.parametrize("fmt", ["bf16", "int4", "int8"])
@pytest.mark.parametrize("T", [1, 8])
@pytest.mark.parametrize("split_k", [(2, 1), (3, 2), (8, 4)])
def test_decode_steps_with_k_split_equal_the_whole_sums(fmt, T, split_k):
    """The GEMV kernels' split K (more programs for few tokens): the splits' sums added in a fixed order
    give the unsplit result up to float32 rounding, and the same result every run."""
    from hybridmoe.experts.gpu_experts_triton import triton_experts

    H, I = 1600, 1088  # more than one split's worth of 512-column steps in gate/up and in down
    experts = packed("int4" if fmt == "bf16" else fmt, 32 if fmt != "int8" else 128, False, H, I, torch.bfloat16)
    if fmt == "bf16":
        experts = tuple(m.dense() for m in experts)
    x, ids, weights, mask = routing(T, H, torch.bfloat16)
    whole = triton_experts(x, *experts, ids, weights, mask, gemv=True, split_k=(1, 1))
    split = triton_experts(x, *experts, ids, weights, mask, gemv=True, split_k=split_k)
    torch.testing.assert_close(split, whole, atol=1e-4 * whole.abs().max().item(), rtol=0)
    assert torch.equal(split, triton_experts(x, *experts, ids, weights, mask, gemv=True, split_k=split_k))


@cuda_only
@pytest.mark.parametrize("fmt", ["bf16", "int4", "int8"])
@pytest.mark.parametrize("T", [1, 4, 9])
@pytest.mark.parametrize("split_k", [(1, 1), (2, 3)])
def test_gemv_kernels_equal_the_dot_kernels(fmt, T, split_k):
    """The slot-major GEMV kernels (gpu_experts_gemv_triton.py), whichever step they are given (repeated experts
    within a token and across tokens, masked slots), sum the products the tl.dot kernels sum, in another order."""
    from hybridmoe.experts.gpu_experts_triton import triton_experts

    H, I = 640, 576  # past the GEMV's 512-column int4 steps: a split's step ends past the last group
    experts = packed("int4" if fmt == "bf16" else fmt, 64, fmt == "int4", H, I, torch.bfloat16)
    if fmt == "bf16":
        experts = tuple(m.dense() for m in experts)
    x, ids, weights, mask = routing(T, H, torch.bfloat16)
    gemv = triton_experts(x, *experts, ids, weights, mask, split_k=split_k, gemv=True)
    dot = triton_experts(x, *experts, ids, weights, mask, gemv=False)
    assert_near(gemv, dot)
    assert_near(gemv, weighted_experts(x, *(m.dense() if fmt != "bf16" else m for m in experts), ids, weights, mask,
                                       F.silu))
    assert torch.equal(gemv, triton_experts(x, *experts, ids, weights, mask, split_k=split_k, gemv=True))


@cuda_only
@pytest.mark.parametrize("T", [1, 8])
def test_packed_experts_replayed_in_a_cuda_graph(T):
    experts = packed("int4", 32, False, 224, 96, torch.bfloat16)
    x, ids, weights, mask = routing(T, 224, torch.bfloat16)
    eager = fixed_shape_experts(x, *experts, ids, weights, mask, F.silu)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = fixed_shape_experts(x, *experts, ids, weights, mask, F.silu)
    for buf, new in zip((x, ids, weights, mask), routing(T, 224, torch.bfloat16, seed=100)):
        buf.copy_(new)
    graph.replay()
    assert_near(replayed, weighted_experts(x, *(m.dense() for m in experts), ids, weights, mask, F.silu))
    assert not torch.equal(replayed, eager)


@cuda_only
def test_streamed_prefill_runs_packed_resident_experts():
    from hybridmoe.experts.packed_torch import PackedLayout
    from hybridmoe.experts.streamed_prefill import routed_experts

    H, I, T = 224, 96, 300
    streamed = CpuExperts(*(torch.randn(E, *s) / 8 for s in ((I, H), (I, H), (H, I))), format="int4", group_size=32)
    state = streamed.packed_state()
    layout = PackedLayout(state)
    buffers = {n: torch.as_tensor(b).view(torch.uint8).reshape(-1).cuda() for n, b in state["buffers"].items()}
    resident = packed("int4", 32, False, H, I, torch.bfloat16)
    x, ids, weights, mask = routing(T, H, torch.bfloat16)
    on_gpu = mask & (torch.rand(T, K, device="cuda") < 0.5)
    got = routed_experts(layout, buffers, x, ids, weights, mask & ~on_gpu, F.silu, resident, on_gpu)
    deq = layout.dequantize(buffers, torch.arange(E, device="cuda"), torch.bfloat16)
    want = (weighted_experts(x, *deq, ids, weights, mask & ~on_gpu, F.silu)
            + weighted_experts(x, *(m.dense() for m in resident), ids, weights, on_gpu, F.silu))
    assert_near(got, want)


def assert_packed_split_gives_the_all_cpu_tokens(checkpoint, gpu_experts: int):
    """A bf16 checkpoint on CUDA with int4 experts, gpu_experts a layer on the GPU kept packed: the greedy tokens of
    the same engine with every expert on the CPU. Returns the layer split of the first MoE layer."""
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[5, 17, 3, 60, 22, 9, 41], [7, 13]]
    options = {"expert_backend": "native", "expert_format": "int4", "expert_group_size": 32}
    every_on_cpu = LLM(checkpoint, device="cuda", gpu_experts_per_layer=0, **options)
    want = [o.token_ids for o in every_on_cpu.generate(prompts, greedy)]
    del every_on_cpu
    gc.collect()
    llm = LLM(checkpoint, device="cuda", gpu_experts_per_layer=gpu_experts, gpu_memory_budget=1 << 30, **options)
    experts = llm.engine.runner.model.experts
    split = experts._layers[experts.layers()[0]]
    assert all(isinstance(m, PackedMatrix) and m.format == "int4" and m.shape[0] == gpu_experts
               for m in split.gpu_weights)
    assert experts.plan.footprint.gpu_format == "int4"
    got = [o.token_ids for o in llm.generate(prompts, greedy)]
    # the same int4 codes wherever an expert is placed: only the sums' rounding differs (tiny random models
    # have near-ties, so the first tokens)
    assert [t[:4] for t in got] == [t[:4] for t in want]
    return split


@cuda_only
def test_a_hybrid_int4_model_keeps_its_gpu_experts_packed_and_gives_the_all_cpu_tokens(tmp_path):
    make_checkpoint("qwen3_moe", "tiny", tmp_path, dtype="bf16", seed=1, progress=False)
    assert_packed_split_gives_the_all_cpu_tokens(tmp_path, 5)


GLU = ClampedSwiGLU(alpha=1.702, limit=1.0)
"""A limit the gate and up sums pass (both ways for up) at routing()'s scale, so the clamps bind."""
GPT_OSS_CASES = [("int4", 32, False, 128, 64), ("int4", 64, True, 128, 64), ("int8", 128, False, 96, 40)]
"""(fmt, group, zero_points, H, I): small enough for the interpreter; I = 40 is no multiple of int8's 32-row blocks."""


def gpt_oss_biases(H: int, I: int, dtype: torch.dtype, seed: int = 0):
    """(gate [E, I], up [E, I], down [E, H]) standard normal, in dtype on DEVICE."""
    g = torch.Generator().manual_seed(H + I + seed)
    return tuple(torch.randn(E, n, generator=g).to(DEVICE, dtype) for n in (I, I, H))


def float32_reference(x, experts, ids, weights, mask, biases=None, act=GLU) -> torch.Tensor:
    """weighted_experts in float32 over the packed experts' weights (as the kernels dequantize them) and biases."""
    dense = tuple((m.dense() if isinstance(m, PackedMatrix) else m).float() for m in experts)
    f32 = tuple(b.float() for b in biases) if biases is not None else None
    return weighted_experts(x.float(), *dense, ids, weights, mask, act, f32)


def assert_float32_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=1e-4)
    else:
        assert_near(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=cuda_only)])
@pytest.mark.parametrize("T,gemv,split_k", [(1, True, None), (1, True, (2, 2)), (1, False, None), (9, False, None),
                                            pytest.param(4, True, (2, 1), marks=cuda_only),
                                            pytest.param(300, False, None, marks=cuda_only)])
@pytest.mark.parametrize("fmt,group,zero_points,H,I", GPT_OSS_CASES)
def test_packed_gpt_oss_experts_equal_the_float32_reference(fmt, group, zero_points, H, I, T, gemv, split_k, dtype):
    """The GEMV kernels (whole, and with K split: each bias added once) and the dot kernels (expert-major, sorted
    blocks) with biases and the clamped SwiGLU, on int4 / int8 codes."""
    from hybridmoe.experts.gpu_experts_triton import triton_experts

    experts = packed(fmt, group, zero_points, H, I, dtype)
    x, ids, weights, mask = routing(T, H, dtype)
    biases = gpt_oss_biases(H, I, dtype)
    got = triton_experts(x, *experts, ids, weights, mask, GLU, biases, gemv=gemv, split_k=split_k)
    want = float32_reference(x, experts, ids, weights, mask, biases)
    assert got.dtype == torch.float32 and got.shape == (T, H)
    assert_float32_close(got, want, dtype)
    assert (float32_reference(x, experts, ids, weights, mask) - want).abs().max() > 0.05 * want.abs().max()


def streamed_layer(fmt: str, H: int, I: int, seed: int = 0):
    """A CPU engine's experts in fmt with gpt-oss's activation, as streamed: (layout, its buffers on DEVICE)."""
    from hybridmoe.experts.packed_torch import PackedLayout

    g = torch.Generator().manual_seed(seed)
    engine = CpuExperts(*(torch.randn(E, *shape, generator=g) / 8 for shape in ((I, H), (I, H), (H, I))),
                        format=fmt, group_size=32)
    engine.set_glu(GLU)
    state = engine.packed_state()
    buffers = {n: torch.as_tensor(b).view(torch.uint8).reshape(-1).to(DEVICE) for n, b in state["buffers"].items()}
    return PackedLayout(state), buffers


@pytest.mark.parametrize("T", [9, pytest.param(300, marks=cuda_only)])
@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_streamed_prefill_adds_the_biases_of_its_packed_and_resident_experts(fmt, T):
    """A long step's share from streamed packed bytes (several chunks of experts on the interpreter, whatever
    DEQUANT_WORKSPACE_BYTES gives on the GPU) beside packed resident experts, each with its biases, through the
    streamed prefill's Triton kernels (on CUDA the path routed_experts takes)."""
    from hybridmoe.experts import streamed_prefill

    H, I = 128, 64
    layout, buffers = streamed_layer(fmt, H, I)
    resident = packed("int4", 32, False, H, I, torch.float32)
    x, ids, weights, mask = routing(T, H, torch.float32)
    on_gpu = mask & (torch.rand(T, K, generator=torch.Generator().manual_seed(T)) < 0.5).to(DEVICE)
    biases, resident_biases = gpt_oss_biases(H, I, torch.float32), gpt_oss_biases(H, I, torch.float32, seed=1)
    if DEVICE == "cuda":
        got = streamed_prefill.routed_experts(layout, buffers, x, ids, weights, mask & ~on_gpu, GLU, resident, on_gpu,
                                              biases, resident_biases)
    else:  # routed_experts takes its Triton form on CUDA only: here that form itself, 2 experts a chunk
        got = streamed_prefill._routed_triton(layout, buffers, x, ids, weights, mask & ~on_gpu, 2, (resident, on_gpu),
                                              GLU, biases, resident_biases)
    deq = layout.dequantize(buffers, torch.arange(E, device=DEVICE), torch.float32)
    want = (float32_reference(x, deq, ids, weights, mask & ~on_gpu, biases)
            + float32_reference(x, resident, ids, weights, on_gpu, resident_biases))
    torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=1e-4)


@cuda_only
def test_a_hybrid_gpt_oss_model_keeps_its_gpu_experts_packed_and_gives_the_all_cpu_tokens(tmp_path):
    """gpt-oss (biases, clamped SwiGLU, sinks) on CUDA with int4 experts, 3 a layer packed on the GPU (the Triton GPU
    share with biases; decode steps in fixed shapes and CUDA graphs, attention with sinks in the decode kernels):
    the tokens of the same engine with every expert on the CPU."""
    make_checkpoint("gpt_oss", "tiny", tmp_path, dtype="bf16", seed=1, progress=False)
    split = assert_packed_split_gives_the_all_cpu_tokens(tmp_path, 3)
    assert split.gpu_biases[0].shape == (3, 32) and split.cpu.has_biases and split.cpu.glu is not None
