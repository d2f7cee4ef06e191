"""An Anthropic Messages request as the chat route's input: the messages the chat template reads (the layout
serving_chat.message_dict gives OpenAI's), and the tool plan of tool_choice.plan (the reader of the
output's calls, the grammar that forces them, the template's tools and enable_thinking).

Anthropic's conversation maps onto the chat layout block by block: a tool_use block is a call in its assistant
message's tool_calls, a tool_result block a {"role": "tool"} message, thinking blocks of earlier answers are left
out (as the chat route leaves out reasoning_content). Its tools and tool_choice map onto OpenAI's: "any" is
"required", "tool" a named function, disable_parallel_tool_use is parallel_tool_calls false.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridmoe.server.anthropic_protocol import (
    ContentBlock,
    ConversationRequest,
    InnerBlock,
    ThinkingConfig,
    Tool,
    ToolChoice,
)
from hybridmoe.server.protocol import (
    FunctionDef,
    NamedFunction,
    NamedToolChoice,
    ToolDef,
)
from hybridmoe.server.serving_common import APIError
from hybridmoe.server.tool_choice import Marker, ToolPlan, plan, quoted

TEXT_BLOCK_SEPARATOR = "\n\n"
"""Between the text blocks of one message (or of the system prompt or of a tool result), and between consecutive
turns of one role, which Anthropic merges into one turn: the chat template sees one string a message."""

SKIPPED_BLOCKS = frozenset({"thinking", "redacted_thinking"})
"""Assistant blocks read and left out of the prompt: the chat templates drop an earlier answer's reasoning."""

Located = tuple[str, ContentBlock]
"""A block and where it stands in the request ("messages.2.content.0"), for the errors that name it."""

SERVED_IN_SYSTEM = "the system prompt reads 'text' blocks"
SERVED_IN_ASSISTANT = "an assistant turn reads 'text', 'tool_use', 'thinking' and 'redacted_thinking' blocks"
SERVED_IN_USER = "a user turn reads 'text' and 'tool_result' blocks"
SERVED_IN_RESULT = "a tool_result's content reads 'text' blocks"


@dataclass(frozen=True)
class ChatInput:
    messages: list[dict]
    plan: ToolPlan


def chat_input(chat_template: str | None, req: ConversationRequest, marker: Marker = quoted) -> ChatInput:
    """req's conversation and tools as the chat route renders and reads them (marker: how the grammar of forced
    calls writes the format's markers, tool_choice.marker_for the model's vocabulary); a 400 names what cannot
    be."""
    return ChatInput(anthropic_messages_to_chat(req), tool_plan(chat_template, req, marker))


def anthropic_messages_to_chat(req: ConversationRequest) -> list[dict]:
    """The conversation as the chat template takes it: the system prompt first as a {"role": "system"} message,
    then the turns, consecutive turns of one role merged into one as Anthropic merges them. A final assistant
    turn (a prefill, which the answer would have to continue) is a 400."""
    last = len(req.messages) - 1
    if req.messages[last].role == "assistant":
        raise APIError(400, f"messages.{last}: the conversation ends with an assistant turn (a prefill, which "
                            "the answer would continue); that is not supported yet: end it with a user turn",
                       param=f"messages.{last}")
    system = _text([(f"system.{j}", b) for j, b in enumerate(req.system or [])], SERVED_IN_SYSTEM)
    chat = [{"role": "system", "content": system}] if system else []
    turns: list[tuple[str, list[Located]]] = []
    for i, m in enumerate(req.messages):
        blocks = [(f"messages.{i}.content.{j}", b) for j, b in enumerate(m.content)]
        if turns and turns[-1][0] == m.role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((m.role, blocks))
    for role, blocks in turns:
        chat += _assistant_message(blocks) if role == "assistant" else _user_messages(blocks)
    return chat


def _assistant_message(blocks: list[Located]) -> list[dict]:
    """One assistant message: its text, and its tool_use blocks as tool_calls (arguments as the input object)."""
    texts, calls = [], []
    for where, b in blocks:
        if b.type == "tool_use":
            calls.append({"id": _needs(b, "id", where), "type": "function",
                          "function": {"name": _needs(b, "name", where), "arguments": _needs(b, "input", where)}})
        elif b.type not in SKIPPED_BLOCKS:
            texts.append((where, b))
    message = {"role": "assistant", "content": _text(texts, SERVED_IN_ASSISTANT)}
    return [{**message, "tool_calls": calls} if calls else message]


def _user_messages(blocks: list[Located]) -> list[dict]:
    """A user turn in its blocks' order: each run of text blocks a user message, each tool_result a tool
    message. is_error has no place in the chat layout: the result's own text says what failed."""
    messages, texts = [], []
    for where, b in blocks:
        if b.type == "tool_result":
            if texts:
                messages.append({"role": "user", "content": _text(texts, SERVED_IN_USER)})
                texts = []
            content = _text([(f"{where}.content.{k}", inner) for k, inner in enumerate(b.content or [])],
                            SERVED_IN_RESULT)
            messages.append({"role": "tool", "tool_call_id": _needs(b, "tool_use_id", where), "content": content})
        else:
            texts.append((where, b))
    if texts or not messages:
        messages.append({"role": "user", "content": _text(texts, SERVED_IN_USER)})
    return messages


def _text(blocks: list[tuple[str, InnerBlock]], served: str) -> str:
    """The text blocks' text joined; a block of another type is a 400 that says what is served there."""
    for where, block in blocks:
        if block.type != "text":
            raise APIError(400, f"{where}: content blocks of type {block.type!r} are not supported here; {served}",
                           param=f"{where}.type")
        _needs(block, "text", where)
    return TEXT_BLOCK_SEPARATOR.join(block.text for _, block in blocks)


def _needs(block: InnerBlock, name: str, where: str):
    value = getattr(block, name)
    if value is None:
        raise APIError(400, f"{where}.{name}: a {block.type} block needs its {name}", param=f"{where}.{name}")
    return value


def tool_plan(chat_template: str | None, req: ConversationRequest, marker: Marker = quoted) -> ToolPlan:
    """req's tools, tool_choice and disable_parallel_tool_use in OpenAI's terms, planned (tool_choice.plan) with
    the template's enable_thinking."""
    tools = [_tool_def(t, f"tools.{i}") for i, t in enumerate(req.tools or [])]
    _check_unique(req.tools or [])
    choice = _choice(req.tool_choice, bool(tools))
    parallel = req.tool_choice is None or not req.tool_choice.disable_parallel_tool_use
    return plan(chat_template, tools or None, choice, parallel, thinking_kwargs(req.thinking), marker)


def _tool_def(tool: Tool, where: str) -> ToolDef:
    if tool.type not in (None, "custom"):
        raise APIError(400, f"{where}.type: tools of type {tool.type!r} are Anthropic's own, which this server "
                            "does not run; offer custom tools (name, description, input_schema)",
                       param=f"{where}.type")
    if tool.input_schema is None:
        raise APIError(400, f"{where}.input_schema: a tool needs its input_schema, the JSON schema of its input",
                       param=f"{where}.input_schema")
    if tool.input_schema.get("type") != "object":
        raise APIError(400, f"{where}.input_schema.type: a tool's input is an object: its schema's type must be "
                            "'object'", param=f"{where}.input_schema.type")
    return ToolDef(type="function", function=FunctionDef(name=tool.name, description=tool.description,
                                                         parameters=tool.input_schema))


def _check_unique(tools: list[Tool]) -> None:
    first: dict[str, int] = {}
    for i, tool in enumerate(tools):
        if tool.name in first:
            raise APIError(400, f"tools.{i}.name: {tool.name!r} names tools.{first[tool.name]} too; tool names "
                                "must be unique", param=f"tools.{i}.name")
        first[tool.name] = i


def _choice(choice: ToolChoice | None, has_tools: bool) -> str | NamedToolChoice | None:
    """OpenAI's tool_choice for Anthropic's; None (the default: auto with tools, none without) for none given,
    and for auto without tools, which asks for nothing."""
    if choice is None or (choice.type == "auto" and not has_tools):
        return None
    if choice.type == "tool":
        if choice.name is None:
            raise APIError(400, "tool_choice.name: tool_choice of type 'tool' needs the name of the tool",
                           param="tool_choice.name")
        return NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def thinking_kwargs(thinking: ThinkingConfig | None) -> dict:
    """The chat template's variables for thinking: enable_thinking false when it is disabled; none otherwise, so
    the template's default holds (enabled and adaptive ask for what the thinking templates do by default). The
    engine does not stop the thinking at budget_tokens: max_tokens bounds the whole answer."""
    if thinking is None:
        return {}
    if thinking.type == "enabled" and thinking.budget_tokens is None:
        raise APIError(400, "thinking.budget_tokens: thinking of type 'enabled' needs its budget_tokens",
                       param="thinking.budget_tokens")
    return {"enable_thinking": False} if thinking.type == "disabled" else {}
