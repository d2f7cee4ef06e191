"""response_format (and Ollama's format) as the engine's StructuredOutput, checked against the model's vocabulary
before the request is queued: a schema the grammar engine cannot use is a 400 naming the field, not a failed
stream."""

from __future__ import annotations

import dataclasses
import json
import re

from hybridmoe.errors import HybridMoEError
from hybridmoe.sampling_params import SamplingParams, StructuredOutput
from hybridmoe.server.prompts import off_loop
from hybridmoe.server.protocol import ResponseFormat
from hybridmoe.server.reasoning import THINK_CLOSE, prompt_opens_reasoning, template_thinks
from hybridmoe.server.serving_common import APIError, ServerState
from hybridmoe.server.tool_choice import COMPACT, Marker

_START = re.compile(r"^start:", re.MULTILINE)


def structured_of(response_format: ResponseFormat | None) -> StructuredOutput | None:
    """The StructuredOutput response_format asks for; None for text or no response_format."""
    if response_format is None or response_format.type == "text":
        return None
    try:
        if response_format.type == "json_object":
            return StructuredOutput("json_object")
        if response_format.json_schema is None:
            raise APIError(400, "response_format of type json_schema needs its json_schema (name and schema)",
                           param="response_format")
        return StructuredOutput("json_schema", json.dumps(response_format.json_schema.json_schema))
    except HybridMoEError as e:
        raise APIError(400, str(e), param="response_format") from None


def ollama_structured(format_: str | dict | None) -> StructuredOutput | None:
    """Ollama's format: "json" (any JSON object) or a JSON schema; None or "" for free text."""
    if format_ in (None, ""):
        return None
    if format_ == "json":
        return StructuredOutput("json_object")
    if isinstance(format_, str):
        raise APIError(400, f"format must be \"json\" or a JSON schema object, got {format_[:40]!r}", param="format")
    try:
        return StructuredOutput("json_schema", json.dumps(format_))
    except HybridMoEError as e:
        raise APIError(400, str(e), param="format") from None


async def check_structured(state: ServerState, spec: StructuredOutput | None, param: str = "response_format") -> None:
    """A 400 naming param when the model's grammar engine cannot use spec (on a prompt thread: a
    large schema takes a while to compile, and the first use builds the vocabulary's token trie)."""
    if spec is None:
        return
    try:
        await off_loop(state, lambda: state.engine.engine.grammars().check(spec))
    except HybridMoEError as e:
        raise APIError(400, str(e), param=param) from None


def reasoning_closed_first(params: SamplingParams, chat_template: str | None, prompt: str,
                           marker: Marker) -> SamplingParams:
    """params whose grammar first closes the reasoning the rendered prompt left open (a template that opens
    <think> for the model, as MiniMax-M2's does): held from the first token, the JSON or the calls would else be
    written inside the reasoning, where the reasoning reader keeps them from the answer. The output starts with
    </think>, so a held answer comes without reasoning. Other grammars are kept as they are."""
    spec = params.structured
    if spec is None or not template_thinks(chat_template) or not prompt_opens_reasoning(prompt):
        return params
    close = f'{marker(THINK_CLOSE)} "\\n"?'
    if spec.kind in ("json_object", "json_schema"):
        schema = json.loads(spec.spec) if spec.kind == "json_schema" else {"type": "object"}
        if not isinstance(schema, dict):  # true / false: any value / none, nothing to hold after </think>
            return params
        grammar = f"start: {close} %json {json.dumps({**schema, 'x-guidance': COMPACT})}\n"
    elif spec.kind == "lark" and _START.search(spec.spec):
        grammar = f"start: {close} answer\n" + _START.sub("answer:", spec.spec)
    else:
        return params
    return dataclasses.replace(params, structured=StructuredOutput("lark", grammar))
