"""gpt-oss's routed experts (per-expert biases and the clamped SwiGLU) in the hybrid GPU/CPU split, the CPU standing in
for the GPU (the GPU share's torch paths: weighted_experts, torch_fixed_experts; experts kept packed int4 / int8
dequantized through packed_torch.py).

make-model's tiny gpt-oss split by gpu_experts_per_layer and by a budget gives the unsplit model's logits (the torch
reference) and transformers' GptOssForCausalLM's, and the same greedy tokens; with deferred experts it equals a
deferral reference written here; its CPU share in the native engine (bf16) gives the reference within bf16's
tolerance, and with the GPU share packed int4 / int8 the native engine's logits with every expert on the CPU. One
layer's split, on inputs large enough that the clamps bind, equals the torch reference in both forms of the GPU share,
and a long step streamed from the CPU engine's packed bytes (experts/streamed_prefill.py) adds the CPU experts' biases;
MXFP4 experts go to a native mxfp4 CPU share as their codes and to the GPU share dequantized.
The Triton kernels with biases and the clamped SwiGLU: tests/device/test_hybrid_gpu_experts.py and
test_packed_gpu_experts_cuda.py.

T tokens, K experts per token, E experts, H hidden, I intermediate, V vocab.
"""

import pytest
import torch
from hybrid_helpers import FP32, PROMPT, load, prompt_logits

from hybridmoe import LLM, SamplingParams
from hybridmoe.checkpoint.make import make_checkpoint
from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import build_model
from hybridmoe.experts.cpu_experts import CpuExperts
from hybridmoe.experts.factory import make_expert_backend
from hybridmoe.experts.gpu_experts import fixed_shape_experts, weighted_experts
from hybridmoe.experts.hybrid import HybridExperts, TorchCpuLayer
from hybridmoe.experts.mxfp4_codes import Mxfp4Codes
from hybridmoe.experts.packed_gpu import PackedMatrix
from hybridmoe.experts.placement import Footprint, PlacementPlan, model_footprint, plan_placement
from hybridmoe.experts.streamed_prefill import PrefillStreamer
from hybridmoe.experts.torch_ref import TorchExperts
from hybridmoe.forward_context import single_sequence_context, use_context
from hybridmoe.layers.clamped_swiglu import ClampedSwiGLU
from hybridmoe.layers.router import topk_softmax
from hybridmoe.models.registry import load_config
from hybridmoe.weights.loader import load_weights
from hybridmoe.weights.quantized import open_checkpoint

BF16 = {"atol": 5e-2, "rtol": 5e-2}
"""The native engine computes in bf16: the bf16 row of the models' tolerance table."""
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss_tiny")
    make_checkpoint("gpt_oss", "tiny", path, dtype="fp32", seed=1, progress=False)
    return path


@pytest.fixture(scope="module")
def reference(checkpoint):
    """The unsplit model (torch reference experts) and its prompt logits [T, V]."""
    loaded = load(checkpoint, expert_backend="torch")
    return loaded, prompt_logits(loaded.model)


@pytest.fixture(scope="module")
def transformers_logits(checkpoint):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([PROMPT])).logits[0].float()


def split_options(how: str, path) -> dict:
    """Engine options that put some, not all, of the 3 layers' 8 experts each on the "GPU": 3 a layer, or 10 from the
    first layer on (front-loading: layer 0 whole, 2 of layer 1's)."""
    if how == "per-layer":
        return {"gpu_experts_per_layer": 3}
    cls, config = load_config(path)
    fp = model_footprint(cls, config, torch.float32, EngineConfig())
    return {"gpu_memory_budget": fp.fixed_bytes + 10 * fp.expert_bytes, "expert_placement": "front-loading"}


@pytest.mark.parametrize("how", ["per-layer", "budget"])
def test_the_split_gives_the_unsplit_and_transformers_logits(checkpoint, reference, transformers_logits, how):
    _, want = reference
    hybrid = load(checkpoint, expert_backend="torch", **split_options(how, checkpoint))
    assert isinstance(hybrid.experts, HybridExperts)
    plan = hybrid.experts.plan
    assert 0 < plan.num_gpu_experts < 8 * len(hybrid.model.moe_layers)
    split = next(st for st in hybrid.experts._layers.values() if st.gpu_weights is not None and st.cpu is not None)
    assert split.gpu_biases[0].shape[0] + split.cpu.biases[0].shape[0] == 8  # each side holds its experts' rows
    got = prompt_logits(hybrid.model)
    torch.testing.assert_close(got, want, **FP32)
    torch.testing.assert_close(got, transformers_logits, **FP32)


def test_the_split_decodes_the_greedy_tokens_of_the_unsplit_model_and_of_transformers(checkpoint):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        expected = hf.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                               do_sample=False, max_new_tokens=12, min_new_tokens=12)[0, len(PROMPT):].tolist()
    unsplit = LLM(checkpoint, dtype="float32", expert_backend="torch", max_num_seqs=1)
    split = LLM(checkpoint, dtype="float32", expert_backend="torch", gpu_experts_per_layer=4, max_num_seqs=1)
    assert isinstance(split.engine.runner.model.experts, HybridExperts)
    assert split.generate(PROMPT, GREEDY)[0].token_ids == unsplit.generate(PROMPT, GREEDY)[0].token_ids == expected


@torch.no_grad()
def deferred_reference(loaded, k: int) -> torch.Tensor:
    """Logits [T, V] of gpt-oss with deferral, layer by layer: at layer L each token's k lowest-weighted experts (ties:
    the later slot) are set aside, and their output (TorchExperts: biases, clamped SwiGLU) joins the residual after
    layer L + 1, or before the final norm after the last layer."""
    model, experts = loaded.model, loaded.experts
    model.allocate_kv_cache(1, 64)
    positions = torch.arange(len(PROMPT))
    with use_context(single_sequence_context(len(PROMPT))):
        h, pending = model.model.embed_tokens(torch.tensor(PROMPT)), None
        for layer in model.model.layers:
            h = h + layer.self_attn(layer.input_layernorm(h), positions)
            x = layer.post_attention_layernorm(h)
            weights, ids = topk_softmax(layer.mlp.router(x), layer.mlp.top_k)
            order = torch.sort(weights, dim=1, descending=True, stable=True).indices
            ids, weights = ids.gather(1, order), weights.gather(1, order)
            keep = ids.shape[1] - k
            h = h + experts.forward(layer.mlp.layer_idx, x, ids[:, :keep], weights[:, :keep])
            if pending is not None:
                h = h + pending
            pending = experts.forward(layer.mlp.layer_idx, x, ids[:, keep:], weights[:, keep:])
        return model.compute_logits(model.model.norm(h + pending))


@pytest.mark.parametrize("gpu_experts", [0, 3])
def test_deferral_equals_the_reference_implementation(checkpoint, reference, gpu_experts):
    want = deferred_reference(reference[0], 1)
    hybrid = load(checkpoint, expert_backend="torch", deferred_experts=1, gpu_experts_per_layer=gpu_experts)
    torch.testing.assert_close(prompt_logits(hybrid.model), want, **FP32)
    assert not torch.allclose(want, reference[1], **FP32)  # deferral changes the logits: the reference is its own


def test_a_native_cpu_share_gives_the_reference_logits(checkpoint, reference):
    hybrid = load(checkpoint, expert_backend="native", expert_format="bf16", cpu_threads=1, gpu_experts_per_layer=3)
    engine = hybrid.experts.cpu_engine(0)
    assert isinstance(engine, CpuExperts) and engine.glu is not None and engine.has_biases
    torch.testing.assert_close(prompt_logits(hybrid.model), reference[1], **BF16)


def native_layers(fmt: str, glu: ClampedSwiGLU):
    """cpu_layer for HybridExperts: a native CpuExperts in fmt (group 32) with gpt-oss's activation."""
    def build(gate, up, down):
        experts = CpuExperts(gate, up, down, format=fmt, group_size=32, threads=1)
        experts.set_glu(glu)
        return experts
    return build


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_gpu_experts_packed_give_the_logits_of_every_expert_on_the_cpu(checkpoint, fmt):
    """The GPU share kept as the CPU engine's codes (PackedMatrix, through packed_torch.py's layout), the rest in the
    native engine: the logits of the same engine with all experts on the CPU (the same codes either side)."""
    all_cpu = load(checkpoint, expert_backend="native", expert_format=fmt, expert_group_size=32, cpu_threads=1)
    cls, config = load_config(checkpoint)
    plan = plan_placement(model_footprint(cls, config, torch.float32, EngineConfig()),
                          EngineConfig(gpu_experts_per_layer=3))
    backend = HybridExperts(plan, "cpu", native_layers(fmt, config.expert_glu), config.expert_glu,
                            num_layers=config.num_hidden_layers, gpu_format=fmt)
    model = build_model(cls, config, backend, torch.float32, "cpu")
    with open_checkpoint(checkpoint, config) as ckpt:
        load_weights(model, ckpt, torch.device("cpu"), torch.float32)
    assert all(isinstance(m, PackedMatrix) for m in backend._layers[0].gpu_weights)
    torch.testing.assert_close(prompt_logits(model), prompt_logits(all_cpu.model), **BF16)


E, H, I, K = 8, 64, 32, 2
GLU = ClampedSwiGLU(alpha=1.702, limit=7.0)


def layer(seed: int = 0):
    """One layer's experts (gate, up [E, I, H], down [E, H, I]) and biases (gate, up [E, I], down [E, H])."""
    g = torch.Generator().manual_seed(seed)
    weights = (torch.randn(E, I, H, generator=g) / 8, torch.randn(E, I, H, generator=g) / 8,
               torch.randn(E, H, I, generator=g) / 6)
    biases = (torch.randn(E, I, generator=g), torch.randn(E, I, generator=g), torch.randn(E, H, generator=g))
    return weights, biases


def step(T: int, seed: int = 1):
    """x [T, H] at a scale where gate passes the clamp and up passes it on both sides; ids [T, K]; weights [T, K]."""
    g = torch.Generator().manual_seed(seed)
    x = 8 * torch.randn(T, H, generator=g)
    w, ids = torch.randn(T, E, generator=g).softmax(-1).topk(K, dim=-1)
    return x, ids, w


def test_one_layers_split_equals_the_torch_reference_where_the_clamps_bind():
    weights, biases = layer()
    x, ids, w = step(23)
    gate_x = torch.einsum("th,eih->tei", x, weights[0]) + biases[0]
    up_x = torch.einsum("th,eih->tei", x, weights[1]) + biases[1]
    assert (gate_x > GLU.limit).any() and (up_x > GLU.limit).any() and (up_x < -GLU.limit).any()
    ref = TorchExperts(glu=GLU)
    ref.set_layer(0, *weights)
    ref.set_layer_biases(0, *biases)
    fp = Footprint(0, 0, 0, 1, [0], E, K, H, I)
    for gpu_ids in ([], [1, 4, 6], list(range(E))):
        split = HybridExperts(PlacementPlan(fp, None, "test", {0: gpu_ids} if gpu_ids else {}), "cpu",
                              lambda g, u, d: TorchCpuLayer(g, u, d, GLU), GLU)
        split.set_layer(0, *weights)
        split.set_layer_biases(0, *biases)
        torch.testing.assert_close(split.forward(0, x, ids, w), ref.forward(0, x, ids, w), **FP32)


@pytest.mark.parametrize("T", [1, 23])
def test_both_forms_of_the_gpu_share_add_the_biases_and_clamp(T):
    """weighted_experts (grouped by expert) and fixed_shape_experts' torch form (T = 1: each slot's expert gathered;
    T = 23: every expert on every token) against TorchExperts on the slots the mask keeps."""
    weights, biases = layer(2)
    x, ids, w = step(T, seed=3)
    mask = torch.rand(T, K, generator=torch.Generator().manual_seed(4)) < 0.7
    mask[0, 0] = True
    ref = TorchExperts(glu=GLU)
    ref.set_layer(0, *weights)
    ref.set_layer_biases(0, *biases)
    want = ref.forward(0, x, ids, torch.where(mask, w, 0.0))
    torch.testing.assert_close(weighted_experts(x, *weights, ids, w, mask, GLU, biases), want, **FP32)
    torch.testing.assert_close(fixed_shape_experts(x, *weights, ids, w, mask, GLU, biases), want, **FP32)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_a_streamed_step_adds_the_cpu_experts_biases(fmt):
    """The CPU engine's packed bytes, streamed and dequantized (here on the CPU device), with the layer's CPU experts'
    biases and a resident expert's: weighted_experts over the engine's own weights with the same biases."""
    weights, biases = layer(5)
    engine = CpuExperts(*weights, format=fmt, threads=1)
    engine.set_glu(GLU)
    x, ids, w = step(40, seed=6)
    resident_ids = ids == 3  # expert 3 also "resident" beside the streamed ones: its slots go there
    resident = tuple(t[3:4] for t in weights)
    resident_biases = tuple(b[3:4] for b in biases)
    streamer = PrefillStreamer({0: engine}, "cpu", min_tokens=1)
    got = streamer.run(0, x, torch.where(resident_ids, 0, ids), w, ~resident_ids, GLU, resident, 0, biases,
                       resident_biases)
    deq = tuple(torch.stack(m) for m in zip(*(engine.dequantized(e) for e in range(E))))
    want = (weighted_experts(x, *deq, ids, w, ~resident_ids, GLU, biases)
            + weighted_experts(x, *resident, torch.zeros_like(ids), w, resident_ids, GLU, resident_biases))
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


def mxfp4_experts(n: int, seed: int) -> list[tuple[Mxfp4Codes, Mxfp4Codes, Mxfp4Codes]]:
    """n experts' (gate [I, H], up [I, H], down [H, I]) as random MXFP4 codes and e8m0 scales 2^-7 .. 2^-5."""
    g = torch.Generator().manual_seed(seed)

    def matrix(N: int, K: int) -> Mxfp4Codes:
        return Mxfp4Codes(torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8),
                          torch.randint(120, 123, (N, K // 32), generator=g, dtype=torch.uint8))

    return [(matrix(I, H), matrix(I, H), matrix(H, I)) for _ in range(n)]


def test_mxfp4_codes_go_to_the_cpu_share_as_they_are_and_to_the_gpu_share_dequantized(checkpoint):
    """The split of a native mxfp4 engine takes a checkpoint's MXFP4 codes (the loader's set_layer_experts): its CPU
    share packs them as they are, its GPU share dequantizes them; the layer gives what the same engine gives with
    every expert on the CPU."""
    cls, config = load_config(checkpoint)
    options = {"expert_backend": "native", "expert_format": "mxfp4", "expert_group_size": 32, "cpu_threads": 1}
    split = make_expert_backend(EngineConfig(gpu_experts_per_layer=3, **options), config, cls, torch.float32)
    whole = make_expert_backend(EngineConfig(**options), config, cls, torch.float32)
    assert isinstance(split, HybridExperts) and split.takes_mxfp4_codes() and whole.takes_mxfp4_codes()
    experts, (_, biases) = mxfp4_experts(E, seed=7), layer(8)
    for backend in (split, whole):
        backend.set_layer_experts(0, iter(experts), E)
        backend.set_layer_biases(0, *biases)
    assert split.cpu_engine(0).format == "mxfp4" and split.cpu_engine(0).num_experts == E - 3
    assert split._layers[0].gpu_weights[0].dtype == torch.float32
    x, ids, w = step(13, seed=9)
    torch.testing.assert_close(split.forward(0, x / 8, ids, w), whole.forward(0, x / 8, ids, w), **BF16)
