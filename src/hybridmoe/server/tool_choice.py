"""tool_choice "required" and a named function as a grammar in the model's own tool-call syntax: the output is
one or more calls (one when parallel_tool_calls is false) whose arguments match the function's parameter schema,
so even a weak model returns a call the client can run.

The grammar is written per tool-call format; a format without one answers 400 (the model may still call tools
with tool_choice "auto", where its output is parsed, not held).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from hybridmoe.sampling_params import StructuredOutput
from hybridmoe.server.protocol import ChatCompletionRequest, NamedToolChoice, ToolDef
from hybridmoe.server.serving_common import APIError
from hybridmoe.server.tool_parsers import ToolParser, parser_for_template

RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                      "pad_token", "unk_token"})
"""chat_template_kwargs names the server sets itself."""

COMPACT = {"whitespace_flexible": False}
"""llguidance's JSON options: no free whitespace, which a weak model would pad with forever."""


def call_schema(tool: ToolDef) -> dict:
    """The JSON object of one call in the Qwen / Hermes layout: {"name": <the name>, "arguments": {...}}."""
    parameters = tool.function.parameters or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def hermes_grammar(tools: list[ToolDef], parallel: bool) -> str:
    """Lark (llguidance's dialect) for <tool_call>\\n{json}\\n</tool_call> calls, one per line."""
    schemas = [call_schema(t) for t in tools]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    call = f'"<tool_call>\\n" %json {json.dumps({**schema, "x-guidance": COMPACT})} "\\n</tool_call>"'
    more = ' ("\\n" call)*' if parallel else ""
    return f"start: call{more}\ncall: {call}\n"


GRAMMARS = {"hermes": hermes_grammar}
"""Tool-call format (tool_parsers.PARSERS' names) -> its grammar of calls."""


def forced_calls(format_name: str, tools: list[ToolDef], choice: str | NamedToolChoice,
                 parallel: bool) -> StructuredOutput:
    """The grammar that holds the output to calls of `tools` (choice "required") or of the named one."""
    if isinstance(choice, NamedToolChoice):
        named = [t for t in tools if t.function.name == choice.function.name]
        if not named:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools",
                           param="tool_choice")
        tools, parallel = named[:1], False
    grammar = GRAMMARS.get(format_name)
    if grammar is None:
        raise APIError(400, f"tool_choice 'required' or a named function needs a grammar of this model's tool-call "
                            f"format ({format_name}), which the server does not have yet; use tool_choice 'auto'",
                       param="tool_choice")
    return StructuredOutput("lark", grammar(tools, parallel))


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask of the server."""

    parser: ToolParser | None = None
    """Reads the calls out of the output (None: no tools offered, the output is the answer)."""
    structured: StructuredOutput | None = None
    """The grammar of tool_choice "required" or a named function."""
    template_kwargs: dict = field(default_factory=dict)
    """The chat template's variables: the tools and the request's chat_template_kwargs."""
    parallel: bool = True
    """Whether more than one call is kept (parallel_tool_calls)."""


def plan_tools(chat_template: str | None, req: ChatCompletionRequest) -> ToolPlan:
    """req's tools, tool_choice and parallel_tool_calls checked (a 400 names what is wrong) and planned. With
    tool_choice "none" the tools are left out of the prompt, so the model is not offered them."""
    kwargs = dict(req.chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets them",
                       param="chat_template_kwargs")
    choice = req.tool_choice or ("auto" if req.tools else "none")
    parallel = req.parallel_tool_calls is not False and not isinstance(choice, NamedToolChoice)
    if choice != "none" and not req.tools:
        raise APIError(400, "tool_choice asks for tool calls, but the request has no tools", param="tool_choice")
    parser = parser_for_template(chat_template)
    if choice == "none":  # gpt-oss's channels (its reasoning among them) need its reader, tools or not
        return ToolPlan(parser if parser is not None and parser.name == "harmony" else None, None, kwargs, parallel)
    if parser is None:
        raise APIError(400, "this model's chat template writes no tool-call format the server reads (Qwen/Hermes, "
                            "DeepSeek-V3, GLM-4.5, Kimi-K2, gpt-oss, Mistral); send the request without tools",
                       param="tools")
    structured = None if choice == "auto" else forced_calls(parser.name, req.tools, choice, parallel)
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    return ToolPlan(parser, structured, {**kwargs, "tools": tools}, parallel)
