"""hybridmoe.hf.offload_experts: a transformers MoE model of each supported family keeps working as itself with its
routed experts in the native CPU engine.

Each family is a tiny random float32 model of transformers' own classes (tiny_families.py), offloaded in bf16 with
one worker thread. The reference is its bf16 twin (transformers' own expert math with bf16 weights and bf16
activations, as the engine's bf16 format computes): logits, every hidden state and what a forward hook on a
decoder layer sees equal the twin's at the float32 tolerance of tests/models/compare.py (they differ by float32
summation order, ~1e-7), and greedy generate() gives the twin's 16 tokens (its top-2 logit margins at each step are
checked to exceed that tolerance many times over, so no rounding can flip an argmax). Against the untouched model,
bf16's own rounding shows: within 0.008 relative (the bf16 row of tests/kernels/conftest.py's table, a layer's
bound vs float32 weights); int8 within 0.03 and int4 at group 32 within 0.19 likewise. The original expert
weights are gone from the model and freed; the router and shared experts stay transformers' modules.
"""

from __future__ import annotations

import copy
import gc
import subprocess
import sys
import weakref
from dataclasses import dataclass

import pytest
import torch
from tiny_families import CASES, VOCAB, bf16_twin, experts_modules, tiny_model
from transformers import LlamaConfig, LlamaForCausalLM

from hybridmoe.errors import HybridMoEError
from hybridmoe.hf import OffloadedExperts, offload_experts

FLOAT32 = {"atol": 1e-4, "rtol": 1e-4}
"""tests/models/compare.py's float32 row: how close two float32 computations of the same function must be."""

PROMPT = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(11))
"""A prompt whose greedy continuation has no near-tie in any family's twin: top-2 margins of at least 4e-3."""
NEW_TOKENS = 16


def rel_err(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours.float() - reference.float()).norm() / reference.float().norm()).item()


@dataclass
class Offloaded:
    family: str
    untouched: torch.nn.Module
    twin: torch.nn.Module
    model: torch.nn.Module
    first_expert_weight: weakref.ref
    expert_params: int
    """How many parameters the routed experts held (E * I * H * 3, plus gpt-oss's biases, over the MoE layers)."""
    router_and_shared: dict[str, type]
    """Each MoE block's other children (router, shared experts, ...): name -> class, before offloading."""


@pytest.fixture(scope="module", params=list(CASES))
def offloaded(request) -> Offloaded:
    family = request.param
    untouched = tiny_model(family)
    model = copy.deepcopy(untouched)
    experts = experts_modules(model, family)
    blocks = [m for m in model.modules() if any(child in experts for child in m.children())]
    siblings = {f"{i}.{name}": type(child) for i, block in enumerate(blocks) for name, child in block.named_children()
                if child not in experts}
    first = weakref.ref(next(experts[0].parameters()))
    expert_params = sum(p.numel() for m in experts for p in m.parameters())
    del experts, blocks
    assert offload_experts(model, expert_format="bf16", cpu_threads=1) is model
    return Offloaded(family, untouched, bf16_twin(untouched, family), model, first, expert_params, siblings)


@torch.no_grad()
def test_logits_and_every_hidden_state_equal_the_bf16_twins(offloaded):
    ours = offloaded.model(PROMPT, output_hidden_states=True)
    twin = offloaded.twin(PROMPT, output_hidden_states=True)
    torch.testing.assert_close(ours.logits, twin.logits, **FLOAT32)
    assert len(ours.hidden_states) == len(twin.hidden_states) == offloaded.model.config.num_hidden_layers + 1
    for i, (h, want) in enumerate(zip(ours.hidden_states, twin.hidden_states)):
        torch.testing.assert_close(h, want, **FLOAT32, msg=lambda m, i=i: f"hidden state {i}: {m}")


@torch.no_grad()
def test_against_the_untouched_model_only_bf16_rounding_shows(offloaded):
    ours = offloaded.model(PROMPT, output_hidden_states=True)
    untouched = offloaded.untouched(PROMPT, output_hidden_states=True)
    errors = [rel_err(h, want) for h, want in zip(ours.hidden_states, untouched.hidden_states)]
    errors.append(rel_err(ours.logits, untouched.logits))
    assert max(errors) < 0.008, errors
    assert max(errors) > 0  # the experts did run in bf16, not transformers' float32 ones


@torch.no_grad()
def test_a_forward_hook_on_a_decoder_layer_fires_and_sees_the_twins_tensors(offloaded):
    seen = {}

    def hook(name):
        def record(module, args, output):
            seen[name] = (output[0] if isinstance(output, tuple) else output).clone()
        return record

    last = offloaded.model.config.num_hidden_layers - 1
    handles = [offloaded.model.model.layers[last].register_forward_hook(hook("ours")),
               offloaded.twin.model.layers[last].register_forward_hook(hook("twin"))]
    try:
        offloaded.model(PROMPT)
        offloaded.twin(PROMPT)
    finally:
        for handle in handles:
            handle.remove()
    assert seen["ours"].shape == (1, PROMPT.shape[1], offloaded.model.config.hidden_size)
    torch.testing.assert_close(seen["ours"], seen["twin"], **FLOAT32)


@torch.no_grad()
def test_greedy_generate_gives_the_twins_tokens(offloaded):
    options = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0,
               "output_scores": True, "return_dict_in_generate": True}
    want = offloaded.twin.generate(PROMPT, **options)
    got = offloaded.model.generate(PROMPT, **options)
    top2 = torch.stack(want.scores).topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min() > 10 * FLOAT32["atol"]  # no flip within the tolerance
    assert got.sequences.shape == (1, PROMPT.shape[1] + NEW_TOKENS)
    assert torch.equal(got.sequences, want.sequences)


def test_the_original_expert_weights_are_gone_and_freed(offloaded):
    model = offloaded.model
    gc.collect()
    assert offloaded.first_expert_weight() is None
    assert not experts_modules(model, offloaded.family)
    offloaded_modules = [m for m in model.modules() if isinstance(m, OffloadedExperts)]
    E, H, I = offloaded_modules[0].cpu_experts.packed_state()["shape"]
    assert max(t.numel() for t in list(model.parameters()) + list(model.buffers())) < E * I * H
    assert offloaded.untouched.num_parameters() - model.num_parameters() == offloaded.expert_params
    assert offloaded_modules and all(not list(m.parameters()) for m in offloaded_modules)
    assert all(m.cpu_experts.format == "bf16" and m.cpu_experts.threads == 1 for m in offloaded_modules)


def test_the_router_and_shared_experts_stay_transformers_modules(offloaded):
    blocks = [m for m in offloaded.model.modules() if any(isinstance(c, OffloadedExperts) for c in m.children())]
    after = {f"{i}.{name}": type(child) for i, block in enumerate(blocks) for name, child in block.named_children()
             if not isinstance(child, OffloadedExperts)}
    assert after == offloaded.router_and_shared


@pytest.mark.parametrize("fmt, group_size, bound", [("int8", None, 0.03), ("int4", 32, 0.19)])
@torch.no_grad()
def test_quantized_formats_stay_within_their_bound(fmt, group_size, bound):
    untouched = tiny_model("qwen3_moe")
    model = offload_experts(copy.deepcopy(untouched), expert_format=fmt, cpu_threads=1,
                            expert_group_size=group_size)
    assert {m.cpu_experts.format for m in model.modules() if isinstance(m, OffloadedExperts)} == {fmt}
    err = rel_err(model(PROMPT).logits, untouched(PROMPT).logits)
    assert 0 < err < bound


def test_an_unsupported_model_is_named_with_the_supported_families():
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(HybridMoEError, match=r"LlamaForCausalLM \(model_type 'llama'\); it supports Qwen2-MoE, "
                                             r"Qwen3-MoE, Mixtral, DeepSeek-V2, DeepSeek-V3, GLM-4.5, gpt-oss, "
                                             r"MiniMax-M2$"):
        offload_experts(LlamaForCausalLM(config))


def test_offloading_twice_says_the_experts_are_already_offloaded():
    model = offload_experts(tiny_model("qwen2_moe"), cpu_threads=1)
    with pytest.raises(HybridMoEError, match="Qwen2MoeForCausalLM's routed experts are already offloaded"):
        offload_experts(model)


def test_a_bad_format_is_the_engines_one_line_error_before_any_layer_changes():
    model = tiny_model("glm4_moe")
    with pytest.raises(HybridMoEError, match="unknown expert format 'int3'"):
        offload_experts(model, expert_format="int3")
    assert len(experts_modules(model, "glm4_moe")) == 2


def test_hybridmoe_hf_imports_transformers_only_when_called_and_needs_the_native_engine():
    code = ("import sys\n"
            "sys.modules['hybridmoe._native'] = None  # an install without the built engine\n"
            "import hybridmoe, hybridmoe.hf\n"
            "assert 'transformers' not in sys.modules\n"
            "from hybridmoe.errors import HybridMoEError\n"
            "try:\n"
            "    hybridmoe.hf.offload_experts(None)\n"
            "except HybridMoEError as e:\n"
            "    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("hybridmoe.hf runs experts in the native CPU expert engine, which is not built")
