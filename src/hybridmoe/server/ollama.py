"""Ollama-compatible routes, so Ollama front-ends work too: POST /api/chat, POST /api/generate
(newline-delimited JSON when streaming, Ollama's default), GET /api/tags, GET /api/version.

Ollama names its sampling knobs in "options" (num_predict, repeat_penalty, ...); they map onto
the same SamplingParams as the OpenAI routes. Durations are in nanoseconds, as Ollama reports.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from hybridmoe.sampling_params import SamplingParams
from hybridmoe.server.chat_output import ChatOutputFormat
from hybridmoe.server.prompts import encode_chat, encode_text, render_chat
from hybridmoe.server.protocol import MAX_TOOLS, StrictRequest, Text, ToolDef, random_id
from hybridmoe.server.reasoning import reasoning_parser
from hybridmoe.server.serving_common import (
    APIError,
    ServerState,
    collect,
    for_prompt,
    request_params,
)
from hybridmoe.server.structured import check_structured, ollama_structured, reasoning_closed_first
from hybridmoe.server.tool_choice import marker_for, plan, reading_markup
from hybridmoe.server.tool_parsers import ParsedOutput
from hybridmoe.server.tool_parsers.base import assemble

OLLAMA_API_VERSION = "0.6.0"
"""The Ollama API version whose routes and fields we follow (front-ends check it)."""


class OllamaOptions(StrictRequest):
    num_predict: int | None = Field(None, ge=-2)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stop: list[Text] | None = None
    repeat_penalty: float | None = Field(None, gt=0, le=10)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)


class OllamaFunction(StrictRequest):
    name: Text
    arguments: dict = Field(default_factory=dict)


class OllamaToolCall(StrictRequest):
    function: OllamaFunction


class OllamaMessage(StrictRequest):
    role: Literal["system", "user", "assistant", "tool"]
    content: Text = ""
    tool_calls: list[OllamaToolCall] | None = Field(None, max_length=MAX_TOOLS)
    tool_name: Text | None = None
    thinking: Text | None = None
    """An earlier answer's reasoning: accepted and left out of the prompt."""

    def as_template_message(self) -> dict:
        d = {"role": self.role, "content": self.content}
        if self.tool_calls:
            d["tool_calls"] = [{"type": "function", "function": c.function.model_dump()} for c in self.tool_calls]
        if self.tool_name:
            d["name"] = self.tool_name
        return d


class OllamaChatRequest(StrictRequest):
    model: Text
    messages: list[OllamaMessage] = Field(default_factory=list)
    stream: bool = True
    options: OllamaOptions = Field(default_factory=OllamaOptions)
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    format: Text | dict | None = None
    think: bool | None = None
    """False turns thinking off where the chat template can (enable_thinking)."""


class OllamaGenerateRequest(StrictRequest):
    model: Text
    prompt: Text = ""
    system: Text | None = None
    raw: bool = False
    stream: bool = True
    options: OllamaOptions = Field(default_factory=OllamaOptions)
    format: Text | dict | None = None


def _check_model(state: ServerState, name: str) -> None:
    # Ollama front-ends append a tag (":latest") to names they list
    if name.split(":")[0] != state.model_name.split(":")[0]:
        state.check_model(name)


def _max_tokens(o: OllamaOptions) -> int | None:
    max_tokens = None if o.num_predict is None or o.num_predict < 0 else o.num_predict
    if max_tokens == 0:
        raise APIError(400, "options.num_predict is 0: nothing would be generated; give at least 1 (or -1)",
                       param="options.num_predict")
    return max_tokens


async def _params(state: ServerState, req: OllamaChatRequest | OllamaGenerateRequest) -> SamplingParams:
    """The request's SamplingParams (its options and format), checked before the prompt is read (for_prompt fits
    them to it)."""
    o, structured = req.options, ollama_structured(req.format)
    await check_structured(state, structured, param="format")
    return request_params(
        max_tokens=_max_tokens(o), temperature=o.temperature, top_p=o.top_p, top_k=o.top_k, min_p=o.min_p,
        presence_penalty=o.presence_penalty, frequency_penalty=o.frequency_penalty,
        repetition_penalty=o.repeat_penalty, stop=o.stop, default_temperature=0.8, structured=structured)


async def chat(state: ServerState, req: OllamaChatRequest, request: Request) -> Response:
    _check_model(state, req.model)
    if not req.messages:  # Ollama's way to load a model: answer done at once
        return JSONResponse(_final(state, req.model, "load", 0, 0, time.perf_counter(), chat=True))
    params = await _params(state, req)
    state.engine.check_capacity()
    template = state.tokenizer.chat_template
    tools = plan(template, req.tools, None, None, {} if req.think is not False else {"enable_thinking": False})
    params = reading_markup(params, tools.parser, template)
    text, ids = await render_chat(state, [m.as_template_message() for m in req.messages], **tools.template_kwargs)
    params = reasoning_closed_first(params, template, text, marker_for(state.tokenizer))
    params = for_prompt(state, params, len(ids), _max_tokens(req.options), req.options.seed)
    output = ChatOutputFormat(tools.parser, reasoning_parser(template, text))
    return await _answer(state, req.model, ids, params, req.stream, request, output)


async def generate(state: ServerState, req: OllamaGenerateRequest, request: Request) -> Response:
    _check_model(state, req.model)
    if not req.prompt:
        return JSONResponse(_final(state, req.model, "load", 0, 0, time.perf_counter(), chat=False))
    params = await _params(state, req)
    state.engine.check_capacity()
    if req.raw or state.tokenizer.chat_template is None:
        ids = await encode_text(state, req.prompt)
    else:
        messages = ([{"role": "system", "content": req.system}] if req.system else []) + [
            {"role": "user", "content": req.prompt}]
        ids = await encode_chat(state, messages)
    params = for_prompt(state, params, len(ids), _max_tokens(req.options), req.options.seed)
    return await _answer(state, req.model, ids, params, req.stream, request, None)


def tags(state: ServerState) -> dict:
    modified = datetime.fromtimestamp(state.created, timezone.utc).isoformat()
    details = {"format": "safetensors", "family": state.engine.engine.model_config.get("model_type", ""),
               "parameter_size": "", "quantization_level": ""}
    return {"models": [{"name": state.model_name, "model": state.model_name, "modified_at": modified,
                        "size": 0, "digest": "", "details": details}]}


def version() -> dict:
    return {"version": OLLAMA_API_VERSION}


async def _answer(state: ServerState, model: str, ids: list[int], params: SamplingParams, streaming: bool,
                  request: Request, output: ChatOutputFormat | None) -> Response:
    """The answer of /api/chat (output: how its text is read) or /api/generate (output None)."""
    start, chat = time.perf_counter(), output is not None
    stream = state.engine.submit(random_id("ollama"), [(ids, params)])
    if streaming:
        return StreamingResponse(_lines(state, model, len(ids), start, stream, output),
                                 media_type="application/x-ndjson")
    out = (await collect(stream, request))[0].output
    body = _final(state, model, out.finish_reason, len(ids), len(out.token_ids), start, chat)
    body["message" if chat else "response"] = _message(output.parse(out.text)) if chat else out.text
    return JSONResponse(body)


def _message(parsed: ParsedOutput) -> dict:
    """Ollama's assistant message: content, thinking, and tool calls with their arguments as objects."""
    message = {"role": "assistant", "content": parsed.content or ""}
    if parsed.reasoning:
        message["thinking"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = [{"function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                                 for c in parsed.tool_calls]
    return message


async def _lines(state: ServerState, model: str, prompt_len: int, start: float, stream,
                 output: ChatOutputFormat | None) -> AsyncIterator[str]:
    """ndjson lines: each piece of text (chat: content or thinking), a chat's tool calls together once the output
    ends, then the final line."""
    chat, reader = output is not None, output.stream() if output is not None else None
    call_deltas = []  # a chat's tool-call deltas so far: its calls go out whole, in one line at the end

    def line(piece) -> str:
        return json.dumps({"model": model, "created_at": _now(), "message" if chat else "response": piece,
                           "done": False}) + "\n"

    try:
        try:
            async for _, out in stream:
                if not chat:
                    if out.new_text:
                        yield line(out.new_text)
                else:
                    deltas = reader.feed(out.new_text) + (reader.finish() if out.finished else [])
                    call_deltas += [d for d in deltas if d.index is not None]
                    for d in deltas:
                        if d.index is None:
                            yield line(_message(ParsedOutput(d.content, [], d.reasoning)))
                    if out.finished and (calls := assemble(call_deltas).tool_calls):
                        yield line({**_message(ParsedOutput(None, calls)), "content": ""})
                if out.finished:
                    yield json.dumps(_final(state, model, out.finish_reason, prompt_len, len(out.token_ids),
                                            start, chat)) + "\n"
        except Exception as e:  # noqa: BLE001 (the headers are sent: Ollama reports errors as a line {"error": ...})
            yield json.dumps({"error": str(e)}) + "\n"
    finally:
        stream.close()


def _final(state: ServerState, model: str, reason: str, prompt_len: int, n: int, start: float,
           chat: bool) -> dict:
    ns = int((time.perf_counter() - start) * 1e9)
    body = {"model": model, "created_at": _now(), "done": True, "done_reason": reason, "total_duration": ns,
            "load_duration": 0, "prompt_eval_count": prompt_len, "eval_count": n, "eval_duration": ns}
    body["message" if chat else "response"] = {"role": "assistant", "content": ""} if chat else ""
    return body


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")
