"""Structured output: a request's grammar as an llguidance matcher over the model's vocabulary, and the token
masks that hold a batch's sampled tokens to their grammars.

llguidance (not xgrammar) because it installs as one abi3 wheel with no dependencies (xgrammar pulls in
transformers and triton) and bounds the work of hostile grammars itself (its parser limits; a grammar past them
puts its matcher into an error state instead of running on).

Per step: the masks of the rows that have a matcher are computed on the CPU, one row after the other on the
calling thread, into one bitmask (one bit per token, [rows, ceil(V / 32)] int32; a row's mask over a 152K-token
vocabulary takes microseconds, where handing the rows to llguidance's thread pool costs milliseconds and
competes with the expert engine's threads), unpacked to one bool per token on the logits' device and applied
there for the whole batch at once (a forbidden token's logit becomes -inf); after the draw each matcher consumes
its row's token. When a grammar is complete only EOS stays allowed, so the sequence ends the usual way.

On CUDA the bitmask goes to the GPU as it is, from pinned memory (a copy that does not wait for the kernels
already queued, so a mask can be computed and sent while the step before it still runs), and is unpacked there;
on the CPU numpy unpacks it (torch's shifts of int32 take tens of milliseconds for a 152K-token row on the CPU).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from hybridmoe.errors import HybridMoEError
from hybridmoe.sampling_params import StructuredOutput


def grammar_text(spec: StructuredOutput) -> str:
    """spec as llguidance grammar text. JSON is written without free whitespace: a grammar that allows any run
    of spaces would let a weak model pad forever instead of closing the object."""
    compact = {"whitespace_flexible": False}
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=compact)
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.spec)
        except ValueError as e:
            raise HybridMoEError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise HybridMoEError(f"a JSON schema is an object or a boolean, got {type(schema).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=compact)
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.spec)
    return llguidance.LLMatcher.grammar_from_lark(spec.spec)


@dataclass
class Grammars:
    """The model's vocabulary for llguidance, and the matchers and masks built over it."""

    tokenizer: llguidance.LLTokenizer
    vocab_size: int

    @classmethod
    def build(cls, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> Grammars:
        """From the model's tokenizer.json text; vocab_size is the logits' width (it may exceed the tokenizer's)."""
        tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=sorted(eos_token_ids))
        return cls(tokenizer, vocab_size)

    def check(self, spec: StructuredOutput) -> None:
        """A HybridMoEError saying what is wrong when spec cannot be used with this vocabulary (a server checks a
        request's grammar before queueing it)."""
        error = llguidance.LLMatcher.validate_grammar(_text(spec), self.tokenizer)
        if error:
            raise _unusable(spec, error)

    def matcher(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """A new matcher of spec at the start of the output; the grammar is compiled once, here (a matcher whose
        grammar fails to compile is in its error state, which says why)."""
        matcher = llguidance.LLMatcher(self.tokenizer, _text(spec), log_level=0)
        if matcher.is_error():
            raise _unusable(spec, matcher.get_error())
        return matcher

    def mask(self, logits: torch.Tensor, matchers: list[tuple[int, llguidance.LLMatcher]]) -> None:
        """Set to -inf, in logits [N, V] (any device), every token the grammar of row i forbids, for each (i,
        matcher) of matchers."""
        if not matchers:
            return
        forbidden = self.forbidden([m for _, m in matchers], logits.device, logits.shape[1])
        if len(matchers) == logits.shape[0] and all(i == k for k, (i, _) in enumerate(matchers)):
            logits.masked_fill_(forbidden, float("-inf"))  # every row has a grammar: in place
            return
        rows = torch.tensor([i for i, _ in matchers], device=logits.device)
        logits[rows] = logits[rows].masked_fill(forbidden, float("-inf"))


    def forbidden(self, matchers: list[llguidance.LLMatcher], device: torch.device, width: int) -> torch.Tensor:
        """bool [len(matchers), width] on device: True where row k's grammar (matchers[k] as it stands) forbids
        the token. On CUDA it is enqueued on the current stream without waiting for the work queued before it."""
        words = (self.vocab_size + 31) // 32
        cuda = device.type == "cuda"
        bits = torch.empty(len(matchers), words, dtype=torch.int32, pin_memory=cuda)
        for k, m in enumerate(matchers):
            m.unsafe_compute_mask_ptr(bits[k].data_ptr(), words * 4)
        if not cuda:
            return unpack_bits(~bits, width).to(device)
        return ~unpack_bits_torch(bits.to(device, non_blocking=True), width)


def unpack_bits(bits: torch.Tensor, width: int) -> torch.Tensor:
    """bits int32 [N, W] on the CPU (bit j of word w: token 32 w + j) -> bool [N, width] on the CPU. numpy's
    unpackbits over the words' little-endian bytes."""
    packed = bits.numpy().view(np.uint8)
    return torch.from_numpy(np.unpackbits(packed, axis=1, count=width, bitorder="little").view(np.bool_))


def unpack_bits_torch(bits: torch.Tensor, width: int) -> torch.Tensor:
    """unpack_bits in torch ops on bits' own device (the GPU's: one element-wise kernel)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    return ((bits.unsqueeze(-1) >> shifts) & 1).view(bits.shape[0], -1)[:, :width].bool()


def advance(matcher: llguidance.LLMatcher, token: int) -> str | None:
    """The matcher past token; why it cannot go on (None when it can)."""
    if not matcher.consume_token(token) or matcher.is_error():
        return f"the output left its grammar: {_one_line(matcher.get_error() or f'token {token} not allowed')}"
    return None


def _text(spec: StructuredOutput) -> str:
    """grammar_text(spec), its conversion's failure as a HybridMoEError."""
    try:
        return grammar_text(spec)
    except HybridMoEError:
        raise
    except Exception as e:  # noqa: BLE001 (llguidance's conversions raise ValueError / RuntimeError alike)
        raise _unusable(spec, e) from None


def _unusable(spec: StructuredOutput, why) -> HybridMoEError:
    return HybridMoEError(f"the {spec.kind.replace('_', ' ')} cannot be used: {_one_line(why)}")


def _one_line(error) -> str:
    return (str(error).strip().splitlines() or [""])[0][:300]
