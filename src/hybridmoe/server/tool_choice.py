"""tool_choice "required" and a named function as a grammar in the model's own tool-call syntax: the output is
one or more calls (one when parallel_tool_calls is false) whose arguments match the function's parameter schema,
so even a weak model returns a call the client can run.

The grammar is written per tool-call format; a format without one answers 400 (the model may still call tools
with tool_choice "auto", where its output is parsed, not held).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field

from hybridmoe.sampling_params import SamplingParams, StructuredOutput
from hybridmoe.server.protocol import ChatCompletionRequest, NamedToolChoice, ToolDef
from hybridmoe.server.reasoning import template_thinks
from hybridmoe.server.serving_common import APIError
from hybridmoe.server.tool_parsers import ToolParser, parser_for_template
from hybridmoe.tokenizer import Tokenizer

RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                      "pad_token", "unk_token"})
"""chat_template_kwargs names the server sets itself."""

COMPACT = {"whitespace_flexible": False}
"""llguidance's JSON options: no free whitespace, which a weak model would pad with forever."""


Marker = Callable[[str], str]
"""A format's marker in a grammar: the special token's reference (<[id]>) when the vocabulary has the marker as
one special token, which a quoted string would never match, else the quoted text."""


def quoted(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def marker_for(tokenizer: Tokenizer) -> Marker:
    """The Marker of a model's vocabulary."""
    def marker(text: str) -> str:
        token = tokenizer.special_token_id(text)
        return quoted(text) if token is None else f"<[{token}]>"
    return marker


def _arguments(tool: ToolDef) -> dict:
    return tool.function.parameters or {"type": "object", "properties": {}}


def _json(schema: dict) -> str:
    return f"%json {json.dumps({**schema, 'x-guidance': COMPACT})}"


def _one_of(schemas: list[dict]) -> dict:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def call_schema(tool: ToolDef) -> dict:
    """The JSON object of one call in the Qwen / Hermes / Mistral layout: {"name": <the name>, "arguments": {...}}."""
    return {"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": _arguments(tool)},
            "required": ["name", "arguments"], "additionalProperties": False}


def hermes_grammar(tools: list[ToolDef], parallel: bool, marker: Marker) -> str:
    """<tool_call>, a newline, the call as JSON, a newline, </tool_call>: calls one per line."""
    call = f'{marker("<tool_call>")} "\\n" {_json(_one_of([call_schema(t) for t in tools]))} "\\n" ' \
           f'{marker("</tool_call>")}'
    return _calls(call, parallel, '"\\n"')


def deepseek_v3_grammar(tools: list[ToolDef], parallel: bool, marker: Marker) -> str:
    """A section of <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME + a fenced JSON block + <｜tool▁call▁end｜>."""
    calls = [f'{marker("<｜tool▁call▁begin｜>")} "function" {marker("<｜tool▁sep｜>")} '
             f'{quoted(t.function.name + chr(10) + "```json" + chr(10))} {_json(_arguments(t))} '
             f'{quoted(chr(10) + "```")} {marker("<｜tool▁call▁end｜>")}' for t in tools]
    return _section(calls, parallel, marker("<｜tool▁calls▁begin｜>"), marker("<｜tool▁calls▁end｜>"))


def kimi_k2_grammar(tools: list[ToolDef], parallel: bool, marker: Marker) -> str:
    """A section of <|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{json}<|tool_call_end|>."""
    calls = [f'{marker("<|tool_call_begin|>")} {quoted("functions." + t.function.name + ":")} /[0-9]/ '
             f'{marker("<|tool_call_argument_begin|>")} {_json(_arguments(t))} {marker("<|tool_call_end|>")}'
             for t in tools]
    return _section(calls, parallel, marker("<|tool_calls_section_begin|>"), marker("<|tool_calls_section_end|>"))


def mistral_grammar(tools: list[ToolDef], parallel: bool, marker: Marker) -> str:
    """[TOOL_CALLS] and a JSON list of {"name", "arguments"} calls."""
    items = {"type": "array", "items": _one_of([call_schema(t) for t in tools]), "minItems": 1,
             **({} if parallel else {"maxItems": 1})}
    return f"start: {marker('[TOOL_CALLS]')} {_json(items)}\n"


def _required_arguments(t: ToolDef, family: str) -> tuple[dict, list[str]]:
    """(properties, required keys) of a tool whose arguments a format writes one by one; 400 for parameters without
    plain properties (anyOf / oneOf / allOf at the top), which such a format cannot write."""
    schema = _arguments(t)
    combined = any(k in schema for k in ("anyOf", "oneOf", "allOf"))
    if combined or not isinstance(schema.get("properties", {}), dict):
        raise APIError(400, f"tool {t.function.name!r}: {family} writes arguments one by one, which needs "
                            f"parameters with plain properties; let the model choose (auto)", param="tools")
    return schema.get("properties", {}), list(schema.get("required", []))


def glm45_grammar(tools: list[ToolDef], parallel: bool, marker: Marker) -> str:
    """<tool_call>NAME, then per required parameter <arg_key>KEY</arg_key> and <arg_value>VALUE</arg_value> on
    lines of their own, then </tool_call>; each value as JSON of its property's schema (a string quoted: the
    parser reads a value that parses as JSON as that JSON)."""
    calls = []
    for t in tools:
        properties, required = _required_arguments(t, "GLM-4.5")
        args = [f'{marker("<arg_key>")} {quoted(key)} {marker("</arg_key>")} "\\n" {marker("<arg_value>")} '
                f'{_json(properties.get(key, {}))} {marker("</arg_value>")} "\\n"' for key in required]
        calls.append(f'{marker("<tool_call>")} {quoted(t.function.name + chr(10))} {" ".join(args)} '
                     f'{marker("</tool_call>")}')
    return _calls(" | ".join(f"({c})" for c in calls), parallel, '"\\n"')


def minimax_m2_grammar(tools: list[ToolDef], parallel: bool, marker: Marker) -> str:
    """A <minimax:tool_call> section of <invoke name="NAME"> blocks, each with one <parameter name="KEY">VALUE
    </parameter> line per required parameter; each value as JSON of its property's schema (as glm45_grammar)."""
    calls = []
    for t in tools:
        properties, required = _required_arguments(t, "MiniMax-M2")
        args = [f'{quoted(f"<parameter name={quoted(key)}>")} {_json(properties.get(key, {}))} '
                f'{quoted("</parameter>" + chr(10))}' for key in required]
        calls.append(f'{quoted(f"<invoke name={quoted(t.function.name)}>" + chr(10))} {" ".join(args)} '
                     f'{quoted("</invoke>" + chr(10))}')
    return _section(calls, parallel, f'{marker("<minimax:tool_call>")} "\\n"', marker("</minimax:tool_call>"))


def harmony_grammar(tools: list[ToolDef], parallel: bool, marker: Marker) -> str:
    """One message on the commentary channel to=functions.NAME, its body JSON, ended by <|call|>: <|call|> stops
    the output, so gpt-oss makes one call per turn whatever parallel says."""
    calls = [f'{marker("<|channel|>")} {quoted("commentary to=functions." + t.function.name + " ")} '
             f'{marker("<|constrain|>")} "json" {marker("<|message|>")} {_json(_arguments(t))} {marker("<|call|>")}'
             for t in tools]
    return "start: " + "\n    | ".join(calls) + "\n"


def _calls(call: str, parallel: bool, separator: str) -> str:
    more = f" ({separator} call)*" if parallel else ""
    return f"start: call{more}\ncall: {call}\n"


def _section(calls: list[str], parallel: bool, begin: str, end: str) -> str:
    more = " call*" if parallel else ""
    return f"start: {begin} call{more} {end}\ncall: " + "\n    | ".join(calls) + "\n"


GRAMMARS: dict[str, Callable[[list[ToolDef], bool, Marker], str]] = {
    "hermes": hermes_grammar, "deepseek_v3": deepseek_v3_grammar, "kimi_k2": kimi_k2_grammar,
    "mistral": mistral_grammar, "glm45": glm45_grammar, "minimax_m2": minimax_m2_grammar,
    "harmony": harmony_grammar}
"""Tool-call format (tool_parsers.PARSERS' names) -> its grammar of calls: every format the server reads has one."""


def forced_calls(format_name: str, tools: list[ToolDef], choice: str | NamedToolChoice, parallel: bool,
                 marker: Marker = quoted) -> StructuredOutput:
    """The grammar that holds the output to calls of `tools` (choice "required") or of the named one."""
    if isinstance(choice, NamedToolChoice):
        named = [t for t in tools if t.function.name == choice.function.name]
        if not named:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools",
                           param="tool_choice")
        tools, parallel = named[:1], False
    return StructuredOutput("lark", GRAMMARS[format_name](tools, parallel, marker))


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


def reading_markup(params: SamplingParams, parser: ToolParser | None, chat_template: str | None) -> SamplingParams:
    """params with special tokens kept in the output's text when a reader needs them: a tool-call reader (most
    formats' markers are special tokens) or the reasoning reader of a template that thinks (GLM-4.5's <think> is
    a special token)."""
    keep = parser is not None or template_thinks(chat_template)
    return dataclasses.replace(params, skip_special_tokens=False) if keep else params


def plan_tools(chat_template: str | None, req: ChatCompletionRequest, marker: Marker = quoted) -> ToolPlan:
    """req's tools, tool_choice, parallel_tool_calls and chat_template_kwargs checked (a 400 names what is wrong)
    and planned (plan)."""
    kwargs = dict(req.chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets them",
                       param="chat_template_kwargs")
    return plan(chat_template, req.tools, req.tool_choice, req.parallel_tool_calls, kwargs, marker)


def plan(chat_template: str | None, tools: list[ToolDef] | None, tool_choice: str | NamedToolChoice | None,
         parallel_tool_calls: bool | None, template_kwargs: dict, marker: Marker = quoted) -> ToolPlan:
    """A request's tools planned, whichever API it came through (OpenAI's names: tool_choice None is "auto" with
    tools, else "none"). With tool_choice "none" the tools are left out of the prompt, so the model is not offered
    them."""
    choice = tool_choice or ("auto" if tools else "none")
    parallel = parallel_tool_calls is not False and not isinstance(choice, NamedToolChoice)
    if choice != "none" and not tools:
        raise APIError(400, "tool_choice asks for tool calls, but the request has no tools", param="tool_choice")
    parser = parser_for_template(chat_template)
    if choice == "none":  # gpt-oss's channels (its reasoning among them) need its reader, tools or not
        harmony = parser if parser is not None and parser.name == "harmony" else None
        return ToolPlan(harmony, None, template_kwargs, parallel)
    if parser is None:
        raise APIError(400, "this model's chat template writes no tool-call format the server reads (Qwen/Hermes, "
                            "DeepSeek-V3, GLM-4.5, Kimi-K2, MiniMax-M2, gpt-oss, Mistral); send the request without tools",
                       param="tools")
    structured = None if choice == "auto" else forced_calls(parser.name, tools, choice, parallel, marker)
    dumped = [t.model_dump(exclude_none=True) for t in tools]
    return ToolPlan(parser, structured, {**template_kwargs, "tools": dumped}, parallel)
