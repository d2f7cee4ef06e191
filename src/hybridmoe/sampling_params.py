"""How one request is sampled and when it stops. Field names and defaults follow vLLM / OpenAI.

Every field is checked on construction against the range the sampler computes exactly in float32: a value
outside it (a temperature of 1e-40 turns every logit into inf) is a HybridMoEError naming the field, so
that no request can fail inside the engine for its parameters. Stop strings are bounded in count and length:
matching them costs each generated token of the request time in proportion to their length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hybridmoe.errors import HybridMoEError

MIN_TEMPERATURE = 1e-2
"""The smallest temperature above 0 (greedy): logits divided by it stay finite in float32."""
MAX_TEMPERATURE = 100.0
PENALTY_RANGE = (1e-2, 100.0)
"""repetition_penalty's range: logits divided or multiplied by it stay finite in float32."""
MAX_TOKEN_ID = 2**31 - 1
"""Bound of top_k, max_tokens and stop_token_ids: ints a torch long holds (the engine checks the vocabulary)."""
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 512
"""Longest stop string, in characters."""
MAX_STOP_TOTAL_CHARS = 4096
"""All stop strings of a request together, in characters."""
MAX_GRAMMAR_CHARS = 256 * 1024
"""Longest grammar or JSON schema a request may hold output to, in characters."""
STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "lark")


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match: any JSON object ("json_object", spec empty), a JSON schema ("json_schema", spec
    its JSON text), a regular expression ("regex") or a Lark grammar ("lark", llguidance's dialect). The engine
    masks every token that would leave the grammar, so the output matches it whatever the model prefers."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise HybridMoEError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, "
                                 f"got {_short(self.kind)}")
        if not isinstance(self.spec, str):
            raise HybridMoEError(f"a structured output's spec must be text, got {type(self.spec).__name__}")
        if len(self.spec) > MAX_GRAMMAR_CHARS:
            raise HybridMoEError(f"the {self.kind} holds {len(self.spec)} characters; at most {MAX_GRAMMAR_CHARS}")
        if self.kind != "json_object" and not self.spec:
            raise HybridMoEError(f"a {self.kind} structured output needs its {self.kind.replace('_', ' ')}")


@dataclass
class SamplingParams:
    max_tokens: int = 16
    """Most tokens to generate (the prompt not counted)."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""

    top_k: int = 0
    """Keep only the k most likely tokens; 0 keeps all."""

    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches top_p; 1 keeps all."""

    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one; 0 keeps all."""

    repetition_penalty: float = 1.0
    """Hugging Face semantics: logits of tokens already in prompt or output are divided by it
    (multiplied when negative); 1 disables."""

    presence_penalty: float = 0.0
    """OpenAI semantics: subtracted once from the logit of every token already generated."""

    frequency_penalty: float = 0.0
    """OpenAI semantics: subtracted from a token's logit once per time it was generated."""

    seed: int | None = None
    """Seed of this request's own random generator: the same seed gives the same tokens,
    alone or in a batch. None: the global torch generator."""

    stop: list[str] = field(default_factory=list)
    """Strings that end generation; the returned text stops before the first one."""

    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end generation, besides the model's EOS tokens."""

    ignore_eos: bool = False
    """Keep generating past EOS tokens (benchmarks); stop strings and stop_token_ids still apply."""

    skip_special_tokens: bool = True
    """Leave special tokens out of the returned text."""

    logprobs: int | None = None
    """Also return each generated token's log-probability and the `logprobs` most likely tokens at
    its position (0: only the generated token's), under the model's own distribution (before
    penalties, temperature and filters). None: no log-probabilities."""

    structured: StructuredOutput | None = None
    """Hold the output to a grammar (StructuredOutput); None: free text."""

    def __post_init__(self) -> None:
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise HybridMoEError(f"structured must be a StructuredOutput or None, got {_short(self.structured)}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        _check_int("max_tokens", self.max_tokens, f"an integer in [1, {MAX_TOKEN_ID}]",
                   lambda v: 1 <= v <= MAX_TOKEN_ID)
        _check_float("temperature", self.temperature,
                     f"0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]",
                     lambda v: v == 0 or MIN_TEMPERATURE <= v <= MAX_TEMPERATURE)
        _check_int("top_k", self.top_k, f"an integer in [0, {MAX_TOKEN_ID}] (0 disables)",
                   lambda v: 0 <= v <= MAX_TOKEN_ID)
        _check_float("top_p", self.top_p, "in (0, 1]", lambda v: 0 < v <= 1)
        _check_float("min_p", self.min_p, "in [0, 1]", lambda v: 0 <= v <= 1)
        low, high = PENALTY_RANGE
        _check_float("repetition_penalty", self.repetition_penalty, f"in [{low:g}, {high:g}] (1 disables)",
                     lambda v: low <= v <= high)
        _check_float("presence_penalty", self.presence_penalty, "in [-2, 2]", lambda v: -2 <= v <= 2)
        _check_float("frequency_penalty", self.frequency_penalty, "in [-2, 2]", lambda v: -2 <= v <= 2)
        if self.seed is not None:
            _check_int("seed", self.seed, "an integer in [0, 2**64) or None", lambda v: 0 <= v < 2**64)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, "an integer in [0, 20] or None", lambda v: 0 <= v <= 20)
        _check_stop(self.stop)
        if len(self.stop_token_ids) > MAX_STOP_STRINGS:
            raise HybridMoEError(f"stop_token_ids holds {len(self.stop_token_ids)} ids; at most {MAX_STOP_STRINGS}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, f"integers in [0, {MAX_TOKEN_ID}]", lambda v: 0 <= v <= MAX_TOKEN_ID)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check_stop(stop: list) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise HybridMoEError(f"stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS}")
    for s in stop:
        if not isinstance(s, str) or not s:
            raise HybridMoEError(f"stop must hold non-empty strings, got {s!r}"[:200])
        if len(s) > MAX_STOP_CHARS:
            raise HybridMoEError(f"a stop string has {len(s)} characters; at most {MAX_STOP_CHARS}")
    total = sum(len(s) for s in stop)
    if total > MAX_STOP_TOTAL_CHARS:
        raise HybridMoEError(f"stop strings hold {total} characters together; at most {MAX_STOP_TOTAL_CHARS}")


def _check_int(name, value, allowed, ok) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not ok(value):
        raise HybridMoEError(f"{name} must be {allowed}, got {_short(value)}")


def _check_float(name, value, allowed, ok) -> None:
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not ok(value)):
        raise HybridMoEError(f"{name} must be {allowed}, got {_short(value)}")


def _short(value) -> str:
    """value's repr, cut to a line (a client may send a huge number or string)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**96:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
