"""Expert deferral: K=0 is bit-identical to no deferral; K>0 equals a plain reference written here.

Reference semantics: at MoE layer L each token's K lowest-weighted routed experts are set aside;
their weighted output is added to the residual after decoder layer L+1 (after the last layer: before
the final norm). T tokens, H hidden, K deferred experts per token.
"""

import pytest
import torch
from hybrid_helpers import FP32, PROMPT, load, prompt_logits

from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.deferral import split_deferred
from hybridmoe.experts.torch_ref import ref_moe
from hybridmoe.forward_context import single_sequence_context, use_context
from hybridmoe.layers.router import softmax_topk
from hybridmoe.models.deepseek import DeepseekMoE
from hybridmoe.models.moe_block import SparseMoeBlock


def route(mlp, x):
    """The block's own router: ids [T, top_k], weights [T, top_k]."""
    if isinstance(mlp, SparseMoeBlock):
        weights, ids = softmax_topk(mlp.gate(x), mlp.top_k, mlp.renormalize)
        return ids, weights
    return mlp.gate(x)


def shared(mlp, x):
    if hasattr(mlp, "shared_expert"):  # Qwen2-MoE
        return torch.sigmoid(mlp.shared_expert_gate(x)) * mlp.shared_expert(x)
    return mlp.shared_experts(x) if hasattr(mlp, "shared_experts") else 0


def split_by_loop(ids, weights, k):
    """Each token's slots ordered by weight, largest first (ties: earlier slot first); the last k deferred."""
    now, later = [], []
    for t in range(ids.shape[0]):
        order = sorted(range(ids.shape[1]), key=lambda j: -weights[t, j].item())
        now.append(order[:ids.shape[1] - k])
        later.append(order[ids.shape[1] - k:])
    pick = lambda slots: (ids.gather(1, torch.tensor(slots)), weights.gather(1, torch.tensor(slots)))  # noqa: E731
    return pick(now), pick(later)


@torch.no_grad()
def deferred_reference(loaded, k: int, ids: list[int] = PROMPT) -> torch.Tensor:
    """Logits [T, V] of the model with deferral, layer by layer, experts by ref_moe."""
    model, experts = loaded.model, loaded.experts._weights  # TorchExperts: layer -> (gate, up, down)
    model.allocate_kv_cache(1, 64)
    positions = torch.arange(len(ids))
    with use_context(single_sequence_context(len(ids))):
        h = model.model.embed_tokens(torch.tensor(ids))
        pending = None
        for layer in model.model.layers:
            h = h + layer.self_attn(layer.input_layernorm(h), positions)
            x = layer.post_attention_layernorm(h)
            mlp = getattr(layer, layer.mlp_name)
            deferred = None
            if isinstance(mlp, (SparseMoeBlock, DeepseekMoE)):
                now, later = split_by_loop(*route(mlp, x), k)
                out = ref_moe(x, *experts[mlp.layer_idx], *now).to(x.dtype) + shared(mlp, x)
                deferred = ref_moe(x, *experts[mlp.layer_idx], *later).to(x.dtype)
            else:
                out = mlp(x)
            h = h + out
            if pending is not None:
                h = h + pending
            pending = deferred
        if pending is not None:
            h = h + pending
        return model.compute_logits(model.model.norm(h))


@pytest.mark.parametrize("family,k", [("qwen3_moe", 1), ("qwen2_moe", 1), ("deepseek_v3", 1), ("deepseek_v3", 3)])
@pytest.mark.parametrize("gpu_experts", [0, 3])
def test_deferral_equals_the_reference_implementation(tiny_checkpoints, family, k, gpu_experts):
    path = tiny_checkpoints(family)
    want = deferred_reference(load(path, expert_backend="torch"), k)
    got = prompt_logits(load(path, expert_backend="torch", deferred_experts=k, gpu_experts_per_layer=gpu_experts).model)
    torch.testing.assert_close(got, want, **FP32)
    exact = prompt_logits(load(path, expert_backend="torch").model)
    assert not torch.allclose(got, exact, **FP32)  # deferral does change the model: the reference is not vacuous


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_no_deferral_is_bit_identical_to_the_plain_backend(tiny_checkpoints, backend, family):
    path = tiny_checkpoints(family)
    options = dict(expert_backend=backend, cpu_threads=1)
    plain = prompt_logits(load(path, **options).model)
    # the hybrid path with every expert on the CPU and deferred_experts=0
    hybrid = load(path, deferred_experts=0, gpu_experts_per_layer=0, **options)
    assert type(hybrid.experts).__name__ == "HybridExperts"
    assert torch.equal(prompt_logits(hybrid.model), plain)


def test_deferring_every_routed_expert_is_refused(tiny_checkpoints):
    with pytest.raises(HybridMoEError, match="deferred_experts 2 must be below the model's 2 experts per token"):
        load(tiny_checkpoints("qwen3_moe"), expert_backend="torch", deferred_experts=2)


def test_deferred_experts_switched_on_a_loaded_backend_equal_a_load_with_them(tiny_checkpoints):
    path = tiny_checkpoints("deepseek_v3")
    options = dict(expert_backend="native", cpu_threads=1, gpu_experts_per_layer=3)
    loaded = load(path, **options)
    exact = prompt_logits(loaded.model)
    loaded.experts.set_deferred_experts(2)
    assert torch.equal(prompt_logits(loaded.model), prompt_logits(load(path, deferred_experts=2, **options).model))
    loaded.experts.set_deferred_experts(0)
    assert torch.equal(prompt_logits(loaded.model), exact)
    with pytest.raises(HybridMoEError, match="deferred experts must be between 0 and 3 .* got 4"):
        loaded.experts.set_deferred_experts(4)


def test_split_defers_each_tokens_lowest_weights():
    ids = torch.tensor([[4, 1, 7, 2], [0, 3, 5, 6]])
    w = torch.tensor([[0.1, 0.4, 0.3, 0.2], [0.25, 0.25, 0.4, 0.1]])
    now_ids, now_w, later_ids, later_w = split_deferred(ids, w, 2)
    assert now_ids.tolist() == [[1, 7], [5, 0]] and later_ids.tolist() == [[2, 4], [3, 6]]
    assert torch.equal(later_w, torch.tensor([[0.2, 0.1], [0.25, 0.1]]))
    (ref_now, _), (ref_later, _) = split_by_loop(ids, w, 2)
    assert torch.equal(ref_now, now_ids) and torch.equal(ref_later, later_ids)
    # laid out as their shapes say: the GPU share's kernels read weights[t, k] at t * K + k
    assert all(t.is_contiguous() for t in (now_ids, now_w, later_ids, later_w))


def test_cached_decode_with_deferral_equals_recomputing_the_whole_sequence(tiny_checkpoints):
    from hybridmoe.llm import LLM
    from hybridmoe.sampling_params import SamplingParams

    path = tiny_checkpoints("deepseek_v3")
    llm = LLM(path, expert_backend="torch", deferred_experts=2)
    tokens = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0.0))[0].token_ids
    model = load(path, expert_backend="torch", deferred_experts=2).model
    full = prompt_logits(model, PROMPT + tokens[:-1])
    assert full[len(PROMPT) - 1:].argmax(-1).tolist() == tokens
