"""Training through hybridmoe.hf's offloaded experts: the gradients that reach LoRA adapters, the router and the
embeddings equal those of transformers' own expert math, and LoRA training lowers the loss as it does on the
un-offloaded model.

The gradient reference is tests/hf's bf16 twin (tiny_families.py: transformers' own experts with bf16 weights, x and
h rounded to bf16 as the engine reads them), its roundings made straight-through (the value rounded, the gradient
passed as it is), as the engine's backward treats them. Its forward is the engine's to float32 summation order
(test_offload_experts.py); its backward is not exactly the engine's, so the bound is bf16's, derived as
tests/kernels/test_expert_backward.py derives its own: each bf16 rounding that one side makes and the other does not
adds a relative error of rms below u / sqrt(3) (u = 2^-8), independent ones add in quadrature, so n of them stay
below u sqrt(n). Per MoE layer the engine differs from the twin by one rounding on the float32 kernel paths (generic,
avx2: the routing weights' gradient reads h unrounded, where the forward read it in bf16) and by three on the bf16
paths (avx512, and amx, which runs them in backward: grad_out and the gate/up gradients are also read in bf16); a
gradient collects those of every MoE layer it passes back through. The tiny models have two MoE layers, so the bound
is u sqrt(2) = 0.0055 on the float32 paths and u sqrt(6) = 0.0096 on the bf16 ones (measured: at most 0.0029).
A relative bound of 1e-4, that of identical math, would need a reference that is not transformers' expert code.
"""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
from tiny_families import VOCAB, bf16_twin, tiny_model

from hybridmoe.experts.cpu_experts import available_isas
from hybridmoe.hf import OffloadedExperts, offload_experts
from hybridmoe.hf.chat_data import IGNORE, Example
from hybridmoe.hf.lora_targets import lora_target_modules
from hybridmoe.hf.training import TrainPlan, train

FAMILIES_UNDER_TEST = ["qwen3_moe", "deepseek_v3", "gpt_oss", "mixtral"]
ISAS = available_isas()
PATHS = sorted({"avx2" if "avx2" in ISAS else "generic", ISAS[-1]})
"""A float32 kernel path and the fastest one (the bf16 path where the CPU has AVX-512)."""
BF16_PATHS = {"avx512", "amx"}
BF16_UNIT = 2.0**-8
MOE_LAYERS = 2
TRAINED_BEYOND_LORA = (".mlp.gate.", ".mlp.router.", "embed_tokens.")
"""The router (gate in most families, router in gpt-oss's) and the embeddings: their gradients come through the
experts' backward (routing weights, input)."""


def gradient_bound(path: str) -> float:
    roundings_per_layer = 3 if path in BF16_PATHS else 1
    return BF16_UNIT * math.sqrt(roundings_per_layer * MOE_LAYERS)


def with_lora(model: torch.nn.Module) -> torch.nn.Module:
    """model with rank-4 LoRA on its attention projections, initialized as peft does (B zero) from a fixed seed."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=lora_target_modules("attention", model))
    torch.manual_seed(0)
    return peft.get_peft_model(model, config)


def with_lora_router_and_embeddings_trained(model: torch.nn.Module) -> torch.nn.Module:
    """with_lora, its A and B drawn at random (B nonzero, so that A gets a gradient), the router and the embeddings
    trainable too."""
    wrapped = with_lora(model)
    g = torch.Generator().manual_seed(7)
    for name, p in wrapped.named_parameters():
        if "lora_" in name:
            with torch.no_grad():
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
        elif any(part in name for part in TRAINED_BEYOND_LORA):
            p.requires_grad_(True)
    return wrapped


def gradients(model: torch.nn.Module, input_ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


def rel_err(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).norm() / reference.norm()).item()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("family", FAMILIES_UNDER_TEST)
def test_gradients_of_lora_router_and_embeddings_equal_the_straight_through_twins(family, path):
    untouched = tiny_model(family)
    offloaded = offload_experts(copy.deepcopy(untouched), expert_format="bf16", cpu_threads=1, cpu_isa=path)
    ours = with_lora_router_and_embeddings_trained(offloaded)
    twin = with_lora_router_and_embeddings_trained(bf16_twin(untouched, family, straight_through=True))
    assert {m.cpu_experts.isa for m in ours.modules() if isinstance(m, OffloadedExperts)} == {path}
    input_ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    our_loss, our_grads = gradients(ours, input_ids)
    twin_loss, twin_grads = gradients(twin, input_ids)
    assert our_loss == pytest.approx(twin_loss, rel=1e-5)
    assert our_grads.keys() == twin_grads.keys()
    lora_layers = {int(re.search(r"layers\.(\d+)\.", name)[1]) for name in our_grads if "lora_" in name}
    routers = [name for name in our_grads if ".mlp.gate." in name or ".mlp.router." in name]
    assert lora_layers == set(range(len(untouched.model.layers)))
    assert len(routers) >= MOE_LAYERS and any("embed_tokens" in name for name in our_grads)
    errors = {name: rel_err(our_grads[name], twin_grads[name]) for name in our_grads}
    assert all(twin_grads[name].norm() > 0 for name in our_grads)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= gradient_bound(path), (worst, errors[worst])


def synthetic_examples(n: int = 8, length: int = 24, prompt: int = 8) -> list[Example]:
    """Random token sequences labelled after their first `prompt` tokens: something LoRA can memorize."""
    g = torch.Generator().manual_seed(4)
    examples = []
    for i in range(n):
        ids = torch.randint(2, VOCAB, (length,), generator=g).tolist()
        examples.append(Example(ids, [IGNORE] * prompt + ids[prompt:], i + 1))
    return examples


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_lora_training_lowers_the_loss_as_on_the_unoffloaded_model(family):
    untouched = tiny_model(family)
    offloaded = offload_experts(copy.deepcopy(untouched), expert_format="bf16", cpu_threads=1)
    plan = TrainPlan(lr=1e-2, max_steps=50, batch_size=8, grad_accum=1)
    examples = synthetic_examples()
    curves = {name: train(with_lora(model), examples, plan, show=None)
              for name, model in (("offloaded", offloaded), ("reference", untouched))}
    for name, curve in curves.items():
        print(f"{family} {name}: " + " ".join(f"{loss:.3f}" for loss in curve))
    ours, reference = curves["offloaded"], curves["reference"]
    assert len(ours) == len(reference) == 50
    assert ours[0] == pytest.approx(reference[0], rel=0.01)
    assert ours[-1] < 0.5 * ours[0]
    assert abs(ours[-1] - reference[-1]) <= 0.02 * reference[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_node_gives_the_engines_gradients_in_its_inputs_dtypes(dtype):
    module = next(m for m in offload_experts(tiny_model("qwen3_moe"), cpu_threads=1).modules()
                  if isinstance(m, OffloadedExperts))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 64, generator=g).to(dtype).requires_grad_()
    ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(6)])
    weights = torch.rand(6, 2, generator=g).to(dtype).requires_grad_()
    grad_out = torch.randn(6, 64, generator=g).to(dtype)
    module(x, ids, weights).backward(grad_out)
    engine_dtype = torch.float32 if dtype == torch.float16 else dtype  # the engine reads bf16 and fp32 as they are
    want_x, want_weights = module.cpu_experts.backward(x.detach().to(engine_dtype), ids, weights.detach().float(),
                                                       grad_out.to(engine_dtype))
    assert x.grad.dtype == weights.grad.dtype == dtype
    assert torch.equal(x.grad, want_x.to(dtype)) and torch.equal(weights.grad, want_weights.to(dtype))
    assert x.grad.norm() > 0 and weights.grad.norm() > 0


def test_the_node_takes_no_tokens_and_builds_no_graph_under_no_grad():
    module = next(m for m in offload_experts(tiny_model("gpt_oss"), cpu_threads=1).modules()
                  if isinstance(m, OffloadedExperts))
    x = torch.zeros(0, 64, requires_grad=True)
    weights = torch.zeros(0, 2, requires_grad=True)
    out = module(x, torch.zeros(0, 2, dtype=torch.long), weights)
    out.sum().backward()
    assert out.shape == (0, 64) and x.grad.shape == (0, 64) and weights.grad.shape == (0, 2)
    with torch.no_grad():
        ids = torch.tensor([[0, 1], [2, 3], [4, 5]])
        assert module(torch.randn(3, 64), ids, torch.ones(3, 2, requires_grad=True)).grad_fn is None
