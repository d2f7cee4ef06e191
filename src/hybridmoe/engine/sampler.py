"""Next-token sampling for a batch of sequences, each with its own SamplingParams.

Processing order follows Hugging Face generate: repetition penalty, then temperature, top-k,
top-p, min-p, then softmax and a draw. Greedy rows (temperature 0) take the argmax of the
penalized logits. Every seeded request draws from its own torch.Generator, so its tokens do
not depend on what else is in the batch. A row whose sampling fails (non-finite logits, say) fails
alone: Sampler.sample reports it and samples the others.

Shapes: N sequences, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from hybridmoe.engine.grammar import Grammars, advance
from hybridmoe.errors import HybridMoEError
from hybridmoe.sampling_params import SamplingParams


class SamplerInput:
    """What the sampler needs to know about one sequence."""

    __slots__ = ("params", "prompt_ids", "output_ids", "generator", "matcher")

    def __init__(self, params: SamplingParams, prompt_ids: Seq[int], output_ids: Seq[int],
                 generator: torch.Generator | None = None):
        self.params = params
        self.prompt_ids = prompt_ids
        self.output_ids = output_ids
        self.generator = generator
        self.matcher = None
        """The llguidance matcher of params.structured at this point of the output (engine/grammar.py), or None."""


def apply_penalties(logits: torch.Tensor, rows: list[SamplerInput]) -> torch.Tensor:
    """Repetition (HF: over prompt + output), presence and frequency (OpenAI: over output) penalties.

    logits [N, V] float32, changed in place and returned.
    """
    for i, r in enumerate(rows):
        apply_row_penalties(logits[i], r)
    return logits


def apply_row_penalties(row: torch.Tensor, r: SamplerInput) -> None:
    """apply_penalties of one sequence: row [V], changed in place."""
    p, vocab = r.params, row.shape[0]
    if p.repetition_penalty != 1.0:
        ids = torch.tensor([*r.prompt_ids, *r.output_ids], dtype=torch.long, device=row.device)
        score = row[ids]
        row[ids] = torch.where(score < 0, score * p.repetition_penalty, score / p.repetition_penalty)
    if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and r.output_ids:
        out = torch.tensor(r.output_ids, dtype=torch.long, device=row.device)
        counts = torch.bincount(out, minlength=vocab)[:vocab].to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def apply_filters(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p masks (removed tokens get -inf), row by row.

    logits [N, V] float32; temperature, top_p, min_p [N] float32 (temperature > 0);
    top_k [N] long, 0 disables. Returns a new [N, V] tensor.
    """
    n, vocab = logits.shape
    logits = logits / temperature.unsqueeze(1)
    # Sorted ascending once, for both top-k and top-p (HF keeps ties with the k-th value).
    sorted_logits, sorted_idx = logits.sort(dim=-1)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    # Top-p: drop the low tail whose total probability is at most 1 - top_p; the top token stays.
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    tail = (cum <= (1 - top_p).unsqueeze(1)) & (top_p < 1).unsqueeze(1)
    tail[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(tail, float("-inf"))
    logits = torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)
    # Min-p: relative to the most likely token; the ratio does not change when renormalizing.
    probs = logits.softmax(dim=-1)
    floor = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < floor, float("-inf"))


@dataclass
class TokenLogprobs:
    """A generated token's log-probability, and the most likely tokens' at its position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    """(token id, log-probability) of the most likely tokens, most likely first."""


def token_logprobs(logits: torch.Tensor, tokens: list[int], num_top: list[int]) -> list[TokenLogprobs]:
    """Log-probabilities of the chosen tokens and of each row's num_top most likely ones.

    logits [N, V] float32, as the model gave them (before penalties and filters); tokens: the N
    chosen ids.
    """
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logits.device).unsqueeze(1)).squeeze(1).tolist()
    k = max(num_top, default=0)
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    return [TokenLogprobs(t, lp, list(zip(top_ids[i, :n].tolist(), top_lp[i, :n].tolist())))
            for i, (t, lp, n) in enumerate(zip(tokens, chosen, num_top))]


class Sampler:
    """Turns last-token logits into one next token per sequence; rows with a grammar (SamplerInput.matcher) draw
    only tokens it allows, and their matchers consume the tokens drawn."""

    def __init__(self, grammars: Grammars | None = None):
        self.grammars = grammars

    def __call__(self, logits: torch.Tensor, rows: list[SamplerInput]) -> list[int]:
        """logits [N, V] float32 (may be modified). Returns N token ids; a row that fails raises."""
        tokens, failed = self.sample(logits, rows)
        if failed:
            i, why = next(iter(failed.items()))
            raise HybridMoEError(f"sampling row {i} failed: {why}")
        return tokens

    def sample(self, logits: torch.Tensor, rows: list[SamplerInput]) -> tuple[list[int | None], dict[int, str]]:
        """logits [N, V] float32 (may be modified) -> (N token ids, None where a row failed; {row: why it
        failed}). A row fails alone: its penalties, filters or draw raised (non-finite logits, say)."""
        failed: dict[int, str] = {}
        constrained = [(i, r.matcher) for i, r in enumerate(rows) if r.matcher is not None]
        if constrained:
            self.grammars.mask(logits, constrained)
        for i, r in enumerate(rows):
            _guard(failed, i, apply_row_penalties, logits[i], r)
        for i, nan in enumerate(torch.isnan(logits).any(dim=-1).tolist()):
            if nan:
                failed.setdefault(i, "the logits hold NaN")
        tokens: list[int | None] = logits.argmax(dim=-1).tolist()
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy and i not in failed]
        if sampled:
            try:
                probs = _filtered_probs(logits, rows, sampled)
            except RuntimeError:  # one row's filters raised: the rows apart, so that it fails alone
                probs = [_guard(failed, i, _filtered_probs, logits, rows, [i]) for i in sampled]
            # checked before the draw: on CUDA a bad row would assert on the device and end the process's context
            drawable = (_drawable(probs).tolist() if isinstance(probs, torch.Tensor)
                        else [p is not None and bool(_drawable(p)[0]) for p in probs])
            for j, i in enumerate(sampled):
                if i not in failed and not drawable[j]:
                    failed[i] = "no token has a finite, positive probability after the filters"
            for j, i in enumerate(sampled):
                if i not in failed:
                    drawn = _guard(failed, i, torch.multinomial, probs[j].reshape(-1), 1,
                                   generator=rows[i].generator)
                    tokens[i] = None if drawn is None else int(drawn[0])
        for i, matcher in constrained:
            if i not in failed and (why := advance(matcher, tokens[i])) is not None:
                failed[i] = why
        for i in failed:
            tokens[i] = None
        return tokens, failed


def _filtered_probs(logits: torch.Tensor, rows: list[SamplerInput], sampled: list[int]) -> torch.Tensor:
    """Probabilities [len(sampled), V] of rows `sampled` after temperature, top-k, top-p and min-p."""
    dev = logits.device
    params = [rows[i].params for i in sampled]
    filtered = apply_filters(
        logits[sampled],
        torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev),
        torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev),
        torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
        torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev))
    return filtered.softmax(dim=-1)


def _drawable(probs: torch.Tensor) -> torch.Tensor:
    """Per row of probs [N, V]: whether a draw can take a token (finite, non-negative, not all 0); one reduction
    for all rows, read back once."""
    return torch.isfinite(probs).all(dim=-1) & (probs >= 0).all(dim=-1) & (probs.sum(dim=-1) > 0)


def _guard(failed: dict[int, str], i: int, fn, *args, **kwargs):
    """fn(*args, **kwargs), or None with row i's failure noted in `failed` (torch raises RuntimeError for a
    probability row with inf, nan or negative entries, ValueError / IndexError for bad shapes)."""
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, ValueError, IndexError) as e:
        failed[i] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
        return None
