"""One request's tokens and progress, and the output handed back after each step."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from hybridmoe.engine.detokenizer import Detokenizer
from hybridmoe.engine.kv_blocks import SequenceBlocks, TokenDigests
from hybridmoe.engine.sampler import SamplerInput, TokenLogprobs
from hybridmoe.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """A request's state after a step: everything so far, plus what this step added."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    """Generated token ids so far (the prompt not included)."""
    text: str
    """Generated text so far; stops before a stop string. Empty without a tokenizer."""
    new_token_ids: list[int]
    """Token ids this step added."""
    new_text: str
    """Text this step added (the streaming delta)."""
    finish_reason: str | None
    """"stop" (EOS, stop token or stop string), "length" (max_tokens), "abort", "error" (error says why), or
    None while running."""
    new_logprobs: list[TokenLogprobs] | None = None
    """Log-probabilities of new_token_ids, when SamplingParams.logprobs asks for them."""
    error: str | None = None
    """With finish_reason "error": why this request failed, one line (the other requests of the batch go on)."""
    num_cached_tokens: int = 0
    """Prompt tokens found in the prefix cache (their keys and values were not computed for this request)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class Sequence(SamplerInput):
    """A request inside the engine. Tokens [0, num_computed) are in its KV-cache blocks (blocks.table)."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 detokenizer: Detokenizer | None = None, device: str | torch.device = "cpu"):
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device).manual_seed(params.seed)
        super().__init__(params, list(prompt_ids), [], generator)
        self.request_id = request_id
        self.detokenizer = detokenizer
        self.status = SequenceStatus.WAITING
        self.slot: int | None = None
        """Its row of the block table while it runs."""
        self.blocks = SequenceBlocks()
        self.block_digests: TokenDigests | None = None
        """Its full blocks' digests, computed once each (the scheduler makes it with the pool's block size)."""
        self.num_computed = 0
        self.num_cached_tokens = 0
        """Prompt tokens its first admission found in the prefix cache."""
        self.num_preemptions = 0
        self.latest_snapshot: bytes | None = None
        """The digest of the state snapshot this sequence keeps at the latest block boundary it computed (one at a
        time: the scheduler drops it for the next, engine/state_snapshots.py)."""
        self.finish_reason: str | None = None
        self.error: str | None = None
        """Set when a step fails for this sequence alone (its sampling, its text); the engine then ends it."""
        self.logprobs: list[TokenLogprobs] = []
        """One entry per output token, when params.logprobs asks for them."""
        self._emitted_tokens = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Prompt + output tokens [start, stop)."""
        n = len(self.prompt_ids)
        if stop <= n:
            return self.prompt_ids[start:stop]
        if start >= n:
            return self.output_ids[start - n:stop - n]
        return self.prompt_ids[start:] + self.output_ids[:stop - n]

    def append_token(self, token: int, eos_token_ids: frozenset[int]) -> str:
        """Add a sampled token, decide whether the request is done; returns the new text."""
        p = self.params
        self.output_ids.append(token)
        if token in p.stop_token_ids or (token in eos_token_ids and not p.ignore_eos):
            self.finish_reason = "stop"
        elif len(self.output_ids) >= p.max_tokens:
            self.finish_reason = "length"
        if self.detokenizer is None:
            return ""
        # A stop token's own text is not part of the output.
        decoded = None if self.finish_reason == "stop" else token
        delta, hit_stop_string = self.detokenizer.add(decoded, final=self.finish_reason is not None)
        if hit_stop_string:
            self.finish_reason = "stop"
        return delta

    def output(self, new_text: str) -> RequestOutput:
        new_ids = self.output_ids[self._emitted_tokens:]
        new_logprobs = self.logprobs[self._emitted_tokens:] if self.params.logprobs is not None else None
        self._emitted_tokens = len(self.output_ids)
        return RequestOutput(
            request_id=self.request_id, prompt_token_ids=self.prompt_ids,
            token_ids=list(self.output_ids),
            text=self.detokenizer.emitted_text if self.detokenizer else "",
            new_token_ids=new_ids, new_text=new_text, finish_reason=self.finish_reason, new_logprobs=new_logprobs,
            error=self.error, num_cached_tokens=self.num_cached_tokens)
