"""Anthropic Messages API request and response schemas (the subset hybridmoe serves), as pydantic models.

Requests are validated as protocol.py validates OpenAI's: strictly, unknown fields ignored (the official
clients send fields that mean nothing here: service_tier, cache_control on blocks and tools), every text
field `Text`. Bounds follow Anthropic's API reference (temperature from 0 to 1, max_tokens required,
budget_tokens at least 1024) and the engine's (stop sequences in count and length). A content block is one
model holding the fields of every block type served, each optional, so that a block of a type not served
(image, document, ...) reaches the adapter, which refuses it with a 400 naming it, and a served block missing
a field its type needs gets a 400 naming that field (anthropic_chat.py), rather than a validation error
listing union members.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from hybridmoe.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS
from hybridmoe.server.protocol import MAX_TOOLS, TOOL_NAME, StrictRequest, Text

MAX_BLOCK_TYPE_CHARS = 64
"""Longest block or tool type read: an unknown type is quoted in the error, so its length is bounded."""

MIN_THINKING_BUDGET = 1024
"""Anthropic's least budget_tokens of thinking {"type": "enabled"}."""

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _blocks_of_string(content):
    """A string content as the one text block it is short for, as Anthropic reads it."""
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


class InnerBlock(StrictRequest):
    """A block of a tool_result's content: only type "text" is served."""

    type: Annotated[Text, Field(max_length=MAX_BLOCK_TYPE_CHARS)]
    text: Text | None = None


class ContentBlock(InnerBlock):
    """A block of a message's content or of the system prompt. Served: "text" (text); "tool_use" (id, name,
    input) in assistant turns; "tool_result" (tool_use_id, content, is_error) in user turns; "thinking" and
    "redacted_thinking" in assistant turns, read and left out of the prompt."""

    id: Text | None = None
    name: Text | None = None
    input: dict | None = None
    tool_use_id: Text | None = None
    content: Annotated[list[InnerBlock] | None, BeforeValidator(_blocks_of_string)] = None
    is_error: bool | None = None


Blocks = Annotated[list[ContentBlock], BeforeValidator(_blocks_of_string)]
"""A string or a list of blocks, read as a list of blocks: an error names the block and field at fault."""


class InputMessage(StrictRequest):
    role: Literal["user", "assistant"]
    content: Blocks


class Tool(StrictRequest):
    """A tool the model may call: a custom tool (type absent or "custom") with a JSON schema of its input.
    Anthropic's own tools (web_search_..., bash_..., ...) carry another type, which the adapter refuses."""

    name: Text = Field(pattern=TOOL_NAME)
    description: Text | None = None
    input_schema: dict | None = None
    type: Annotated[Text, Field(max_length=MAX_BLOCK_TYPE_CHARS)] | None = None


class ToolChoice(StrictRequest):
    """auto: the model may call tools; any: it calls one or more; tool: it calls the one named; none: it calls
    none. disable_parallel_tool_use keeps one call at most."""

    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = Field(None, pattern=TOOL_NAME)
    disable_parallel_tool_use: bool = False


class ThinkingConfig(StrictRequest):
    """enabled (with its budget_tokens) and adaptive leave thinking to the chat template's default; disabled
    turns it off where the template can. The engine does not cut the thinking at budget_tokens: max_tokens
    bounds the whole answer, thinking included."""

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(None, ge=MIN_THINKING_BUDGET)


class ConversationRequest(StrictRequest):
    """What /v1/messages and /v1/messages/count_tokens share: the model, the conversation, the tools offered
    and the thinking asked for (all of which shape the prompt), and output_config, read only to refuse a
    format (see anthropic_api.refuse_unbuilt)."""

    model: Text
    messages: list[InputMessage] = Field(min_length=1)
    system: Annotated[list[ContentBlock] | None, BeforeValidator(_blocks_of_string)] = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: dict | None = None


class MessagesRequest(ConversationRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[Annotated[Text, Field(min_length=1, max_length=MAX_STOP_CHARS)]] | None = Field(
        None, max_length=MAX_STOP_STRINGS)
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: dict | None = None
    """Accepted and ignored (Anthropic's user_id for abuse tracking)."""
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    """Not Anthropic's: the OpenAI routes' seed, so that a sampled answer can be drawn again."""


class TextContent(_Response):
    type: Literal["text"] = "text"
    text: str


class ThinkingContent(_Response):
    """The model's reasoning. Its signature is empty: nothing here checks a thinking block sent back."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class ToolUseContent(_Response):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict


ResponseBlock = TextContent | ThinkingContent | ToolUseContent


class AnthropicUsage(_Response):
    """Anthropic's split of the prompt: input_tokens are those computed for this request, the rest were read
    from the prefix cache; the prompt's length is their sum. The server writes no cache on request, so
    cache_creation_input_tokens is 0."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, output_tokens: int, cached_tokens: int) -> AnthropicUsage:
        return cls(input_tokens=prompt_tokens - cached_tokens, output_tokens=output_tokens,
                   cache_read_input_tokens=cached_tokens)


class MessagesResponse(_Response):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[ResponseBlock]
    model: str
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: AnthropicUsage


class TokenCount(_Response):
    input_tokens: int


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"
