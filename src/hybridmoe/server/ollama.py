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
from hybridmoe.server.prompts import encode_chat, encode_text
from hybridmoe.server.protocol import StrictRequest, Text, random_id
from hybridmoe.server.serving_common import (
    APIError,
    ServerState,
    collect,
    for_prompt,
    request_params,
)
from hybridmoe.server.structured import check_structured, ollama_structured

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


class OllamaMessage(StrictRequest):
    role: Literal["system", "user", "assistant", "tool"]
    content: Text = ""


class OllamaChatRequest(StrictRequest):
    model: Text
    messages: list[OllamaMessage] = Field(default_factory=list)
    stream: bool = True
    options: OllamaOptions = Field(default_factory=OllamaOptions)
    tools: list[dict] | None = None  # read to be refused (_refuse_unbuilt)
    format: Text | dict | None = None


class OllamaGenerateRequest(StrictRequest):
    model: Text
    prompt: Text = ""
    system: Text | None = None
    raw: bool = False
    stream: bool = True
    options: OllamaOptions = Field(default_factory=OllamaOptions)
    format: Text | dict | None = None


def _refuse_unbuilt(req: OllamaChatRequest | OllamaGenerateRequest) -> None:
    """A 400 for tool calls, which the server does not do yet: a plain-text answer would look like success."""
    if getattr(req, "tools", None):
        raise APIError(400, "tool calls are not supported yet: send the request without tools", param="tools")


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
    _refuse_unbuilt(req)
    if not req.messages:  # Ollama's way to load a model: answer done at once
        return JSONResponse(_final(state, req.model, "load", 0, 0, time.perf_counter(), chat=True))
    params = await _params(state, req)
    state.engine.check_capacity()
    ids = await encode_chat(state, [m.model_dump() for m in req.messages])
    params = for_prompt(state, params, len(ids), _max_tokens(req.options), req.options.seed)
    return await _answer(state, req.model, ids, params, req.stream, request, True)


async def generate(state: ServerState, req: OllamaGenerateRequest, request: Request) -> Response:
    _check_model(state, req.model)
    _refuse_unbuilt(req)
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
    return await _answer(state, req.model, ids, params, req.stream, request, False)


def tags(state: ServerState) -> dict:
    modified = datetime.fromtimestamp(state.created, timezone.utc).isoformat()
    details = {"format": "safetensors", "family": state.engine.engine.model_config.get("model_type", ""),
               "parameter_size": "", "quantization_level": ""}
    return {"models": [{"name": state.model_name, "model": state.model_name, "modified_at": modified,
                        "size": 0, "digest": "", "details": details}]}


def version() -> dict:
    return {"version": OLLAMA_API_VERSION}


async def _answer(state: ServerState, model: str, ids: list[int], params: SamplingParams, streaming: bool,
                  request: Request, chat: bool) -> Response:
    start = time.perf_counter()
    stream = state.engine.submit(random_id("ollama"), [(ids, params)])
    if streaming:
        return StreamingResponse(_lines(state, model, len(ids), start, stream, chat),
                                 media_type="application/x-ndjson")
    out = (await collect(stream, request))[0].output
    body = _final(state, model, out.finish_reason, len(ids), len(out.token_ids), start, chat)
    body["message" if chat else "response"] = (
        {"role": "assistant", "content": out.text} if chat else out.text)
    return JSONResponse(body)


async def _lines(state: ServerState, model: str, prompt_len: int, start: float, stream,
                 chat: bool) -> AsyncIterator[str]:
    try:
        try:
            async for _, out in stream:
                if out.new_text:
                    piece = {"role": "assistant", "content": out.new_text} if chat else out.new_text
                    yield json.dumps({"model": model, "created_at": _now(), "message" if chat else "response": piece,
                                      "done": False}) + "\n"
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
