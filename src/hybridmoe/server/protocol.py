"""OpenAI request and response schemas (the subset hybridmoe serves), as pydantic models.

Requests are validated strictly (a string where a number belongs is an error, not a guess) and
unknown fields are ignored, as OpenAI's own clients send fields we have no use for (user, store,
metadata), except those that would change the answer (UNSUPPORTED_FIELDS: a 400 names them). Bounds follow OpenAI's API reference; top_k, min_p, repetition_penalty, ignore_eos
and stop_token_ids are the extensions vLLM also accepts. Every text field the server reads is
`Text`: valid Unicode, so a lone UTF-16 surrogate ("\\ud800" in JSON) is an `invalid_unicode` error
(a 400) rather than a failure in the tokenizer or in the answer's encoding.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_serializer
from pydantic_core import PydanticCustomError

MAX_N = 16
"""Most completions one request may ask for (each one is a sequence in the batch)."""

INVALID_UNICODE = "invalid_unicode"
"""The pydantic error type of a Text field that is not valid Unicode."""

_SURROGATE = re.compile("[\ud800-\udfff]")


def _valid_unicode(text: str) -> str:
    if not text.isascii():
        m = _SURROGATE.search(text)
        if m is not None:
            raise PydanticCustomError(
                INVALID_UNICODE, f"holds a lone surrogate (U+{ord(m.group()):04X}) at character {m.start()}, "
                                 "which is not valid Unicode; send the text as UTF-8")
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
"""A string with no lone surrogate: one that UTF-8 can encode and the tokenizer can read."""


class StrictRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(StrictRequest):
    include_usage: bool = False


class JsonSchemaFormat(StrictRequest):
    """response_format's json_schema: OpenAI's name, description, schema and strict (the output is always held to
    the schema, strict or not)."""

    name: Text = Field(max_length=64)
    description: Text | None = None
    json_schema: dict | bool = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictRequest):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingRequest(StrictRequest):
    """Fields shared by /v1/chat/completions and /v1/completions."""

    model: Text | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: Text | list[Annotated[Text, Field(min_length=1)]] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(StrictRequest):
    type: Literal["text"]
    text: Text


MAX_TOOLS = 128
TOOL_NAME = r"^[A-Za-z0-9_.:\-]{1,64}$"


class FunctionDef(StrictRequest):
    name: Text = Field(pattern=TOOL_NAME)
    description: Text | None = None
    parameters: dict | None = None
    """A JSON schema of the arguments (None: no arguments)."""
    strict: bool | None = None


class ToolDef(StrictRequest):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(StrictRequest):
    name: Text = Field(pattern=TOOL_NAME)


class NamedToolChoice(StrictRequest):
    type: Literal["function"]
    function: NamedFunction


class CalledFunction(StrictRequest):
    name: Text
    arguments: Text
    """The arguments as a JSON object's text, as the model wrote them."""


class ToolCallIn(StrictRequest):
    """An earlier turn's tool call, sent back in an assistant message."""

    id: Text
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(StrictRequest):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: Text | None = None
    reasoning_content: Text | None = None
    """An earlier answer's reasoning: accepted and left out of the prompt, as the families' templates do."""

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingRequest):
    UNSUPPORTED_FIELDS: ClassVar[dict[str, str]] = {
        "functions": "send them as tools", "function_call": "send tool_choice",
        "logit_bias": "the sampler does not bias logits", "audio": "the models answer in text",
        "modalities": "the models answer in text", "prediction": "predicted outputs are not used",
        "web_search_options": "the server does not search the web"}
    """Fields OpenAI defines that would change the answer: a 400 names them (parse_body)."""
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[Annotated[str, Field(max_length=64)], bool | int | float | str | None] | None = \
        Field(None, max_length=16)
    """Variables for the chat template (vLLM's): {"enable_thinking": false} turns Qwen3's thinking off."""


class CompletionRequest(SamplingRequest):
    UNSUPPORTED_FIELDS: ClassVar[dict[str, str]] = {"logit_bias": "the sampler does not bias logits",
                                                    "best_of": "each choice is sampled once"}
    prompt: Text | list[int] | list[Text] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: Text | None = None


class PromptTokensDetails(_Response):
    cached_tokens: int
    """Prompt tokens whose keys and values came from the prefix cache."""


class UsageInfo(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> "UsageInfo":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Response):
    content: list[TokenLogprob] | None


class CompletionLogprobs(_Response):
    """The legacy completions format: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class FunctionCallOut(_Response):
    name: str
    arguments: str


class ToolCallOut(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class FunctionDelta(_Response):
    name: str | None = None
    arguments: str | None = None

    @model_serializer(mode="wrap")
    def _only_set_fields(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ToolCallDelta(_Response):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta | None = None

    @model_serializer(mode="wrap")
    def _only_set_fields(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _only_set_fields(self, handler):
        # OpenAI's deltas carry only what changed: {"content": "..."}, and {} with the finish_reason
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "hybridmoe"
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"
