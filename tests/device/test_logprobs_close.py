"""The device tests' comparison of two decodings (logprobs_close.py), checked on the CPU with the tiny DeepSeek-V3
in bfloat16 (near-tied routing everywhere): differences the size of other kernels' rounding pass, flipped
experts included; a wrong attention scale does not. Runs everywhere (no GPU needed)."""

import contextlib

import pytest
import torch
from logprobs_close import TOL, assert_logprobs_close, step_difference
from test_cuda_graph import HYBRID, PROMPTS, runs, runs_forced
from torch import nn

from hybridmoe import LLM
from hybridmoe.checkpoint.make import make_checkpoint


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v3_bf16")
    make_checkpoint("deepseek_v3", "tiny", path, dtype="bf16", seed=1, progress=False)
    llm = LLM(path, device="cpu", **HYBRID)
    return llm, runs(llm)


@contextlib.contextmanager
def rounded_otherwise(llm: LLM, relative: float):
    """Every linear layer's output moved by relative x N(0, 1) of itself and rounded again: about one bfloat16
    ulp here and there, as kernels that sum in another order round."""
    g = torch.Generator().manual_seed(0)
    hooks = [m.register_forward_hook(
        lambda m, args, out: (out.float() * (1 + relative * torch.randn(out.shape, generator=g))).to(out.dtype))
        for m in llm.engine.runner.model.modules() if isinstance(m, nn.Linear)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def test_rounding_sized_differences_are_close(reference):
    llm, want = reference
    with rounded_otherwise(llm, 3e-3):
        forced = runs_forced(llm, want)
    # flipped experts: some steps differ by more than TOL, excused by their routing margins
    assert max(step_difference(o, r) for ours, (_, lp) in zip(forced, want) for o, r in zip(ours, lp)) > TOL[torch.bfloat16]
    assert_logprobs_close(forced, want, PROMPTS[:1] + PROMPTS, llm)


def test_a_wrong_attention_scale_is_not(reference):
    llm, want = reference
    attention = [layer.self_attn for layer in llm.engine.runner.model.model.layers]
    for a in attention:
        a.scale *= 1.1
    try:
        forced = runs_forced(llm, want)
    finally:
        for a in attention:
            a.scale /= 1.1
    with pytest.raises(AssertionError, match="logprobs differ"):
        assert_logprobs_close(forced, want, PROMPTS[:1] + PROMPTS, llm)
