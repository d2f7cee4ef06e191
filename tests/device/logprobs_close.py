"""Two decodings that round differently (other kernels, other summation orders) held to each other step by step.

The tested model decodes teacher-forced: its sampler emits the reference's greedy tokens, so every step of
both sees the same tokens and a difference at one step does not carry into the next ones (free-running
greedy runs part at the first near-tie and cannot be compared after it). At each step, the logprobs of the
reference's 5 most likely tokens must agree within TOL, except at a step where the reference's routing was
within MARGIN of choosing other experts (or groups): there a flipped choice swaps one of K experts (a group
of them under DeepSeek's group-limited routing) scaled by routed_scaling_factor, a jump of up to 1.5 nats
in the tiny DeepSeek-V3 in bfloat16, however correct the kernels.

Margins are in router logits (what rounding perturbs): the gap between the last expert (or group) taken
and the first left; for DeepSeek-V3's sigmoid scores + correction bias, the score gap over sigmoid's
largest slope 1/4 (a group's score, a sum of two scores: over 1/2): the least logit change that flips it.
Measured on the H200 (session 5 r1, tiny DeepSeek-V3 bfloat16, fused_layer on vs off): router logits
differ by up to 0.026 and logits by up to 0.053 between flips; in float32 by 1.5e-6.

Shapes: P positions of a sequence (prompt and tokens so far), M MoE layers, E experts, K experts per token.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from hybridmoe import SamplingParams
from hybridmoe.layers.deepseek_routing import DeepseekRouter
from hybridmoe.models.moe_block import SparseMoeBlock

TOL = {torch.float32: 0.02, torch.bfloat16: 0.2}
"""nats: a logprob's largest difference from the reference's at a step without a routing near-tie. bfloat16:
about 4x the largest measured (logits come rounded to 1/64-1/32 near the top tokens). float32: the tests' experts
are bfloat16 (expert_format), so a rounding difference in an expert's input can move its bfloat16 copy by an ulp;
relative noise of 1e-6 to 1e-4 on every linear output of the tiny models on the CPU moved logprobs by up to 0.015."""

MARGIN = {torch.float32: 1e-3, torch.bfloat16: 0.08}
"""Router logits: a routing choice this close to flipping excuses its step (bfloat16: 3x the largest measured
difference)."""

TOP = 5
"""The reference's most likely tokens compared at each step (out of the 20 logprobs both sides return)."""


def _gaps(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [T, N] -> [T]: the k-th largest minus the (k+1)-th."""
    top = scores.topk(k + 1, dim=-1).values
    return top[:, -2] - top[:, -1]


def _softmax_margin(block: SparseMoeBlock, x: torch.Tensor, logits: torch.Tensor | None) -> torch.Tensor:
    return _gaps((block.gate(x) if logits is None else logits).float(), block.top_k)


def _deepseek_margin(router: DeepseekRouter, x: torch.Tensor, logits: torch.Tensor | None) -> torch.Tensor:
    """The smaller of the group choice's margin and the expert choice's within the kept groups."""
    logits = F.linear(x.float(), router.weight.float()) if logits is None else logits.float()
    if router.scoring_func == "softmax":  # softmax keeps the logits' order: compare those
        scores, expert_slope, group_slope = logits, 1.0, 1.0
        group_score = lambda g: g.max(dim=-1).values  # noqa: E731
    else:
        scores, expert_slope, group_slope = logits.sigmoid() + router.e_score_correction_bias.float(), 0.25, 0.5
        group_score = lambda g: g.topk(min(2, g.shape[-1]), dim=-1).values.sum(dim=-1)  # noqa: E731
    margin = torch.full(scores.shape[:1], float("inf"), device=scores.device)
    if router.topk_method != "greedy" and router.topk_group < router.n_group:
        margin = _gaps(group_score(scores.view(scores.shape[0], router.n_group, -1)), router.topk_group) / group_slope
        scores = scores.masked_fill(~router._group_mask(scores, group_score), float("-inf"))
    return torch.minimum(margin, _gaps(scores, router.top_k) / expert_slope)


def routing_margin(llm, tokens: list[int]) -> float:
    """The smallest margin of the routing choices llm makes at tokens' last position (tokens run as one
    prompt), over all MoE layers; inf for a model without routed experts."""
    margins, hooks = [], []

    def record(margin):
        return lambda m, args, out: margins.append(margin(m, args[0], args[1] if len(args) > 1 else None)[-1].item())

    for module in llm.engine.runner.model.modules():
        if isinstance(module, DeepseekRouter):
            hooks.append(module.register_forward_hook(record(_deepseek_margin)))
        elif isinstance(module, SparseMoeBlock):
            hooks.append(module.register_forward_hook(record(_softmax_margin)))
    try:
        llm.generate([tokens], SamplingParams(max_tokens=1, temperature=0))
    finally:
        for h in hooks:
            h.remove()
    return min(margins, default=float("inf"))


def generate_forced(llm, prompts: list[list[int]], params: SamplingParams, tokens: list[list[int]]) -> list[list]:
    """Each prompt's TokenLogprobs per step, the prompts run as one batch, each sequence's sampler choosing
    tokens[b] (the reference's greedy tokens) instead of its own."""
    engine = llm.engine
    ids = [engine.add_request(p, params) for p in prompts]
    forced = dict(zip(ids, tokens))
    runner = engine.runner
    sampler = runner.sampler
    runner.sampler = SimpleNamespace(  # Sampler.sample's (tokens, failed rows): the reference's tokens, none failed
        sample=lambda logits, seqs: ([forced[s.request_id][len(s.output_ids)] for s in seqs], {}))
    logprobs = {i: [] for i in ids}
    try:
        while engine.has_unfinished():
            for out in engine.step():
                logprobs[out.request_id] += out.new_logprobs
    finally:
        runner.sampler = sampler
    return [logprobs[i] for i in ids]


def step_difference(ours, reference) -> float:
    """The largest |logprob difference| over the reference's TOP tokens; inf if one is not among ours."""
    lp = dict(ours.top)
    lp[ours.token_id] = ours.logprob
    return max(abs(lp[t] - v) if t in lp else float("inf") for t, v in reference.top[:TOP])


def assert_logprobs_close(forced, reference, prompts: list[list[int]], reference_llm) -> None:
    """forced: per sequence, the tested model's TokenLogprobs decoding the reference's tokens (generate_forced);
    reference: per sequence (greedy tokens, TokenLogprobs); prompts: each sequence's prompt; reference_llm: the
    LLM that made reference (its routing margins are computed where a step differs by more than TOL)."""
    dtype = reference_llm.engine.runner.model.lm_head.weight.dtype
    far = []
    for b, (ours, (tokens, want)) in enumerate(zip(forced, reference)):
        assert [o.token_id for o in ours] == tokens
        for i, (o, r) in enumerate(zip(ours, want)):
            diff = step_difference(o, r)
            if diff > TOL[dtype]:
                margin = routing_margin(reference_llm, prompts[b] + tokens[:i])
                if margin > MARGIN[dtype]:
                    far.append(f"sequence {b} token {i}: logprobs differ by {diff:.3g} (over {TOL[dtype]}), "
                               f"routing margin {margin:.3g} (over {MARGIN[dtype]})")
    assert not far, "; ".join(far)
