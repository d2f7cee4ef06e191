"""What every endpoint shares: the server's state, request parsing, errors in OpenAI's JSON,
sampling parameters (checked before the prompt is read, then fitted to each prompt's context),
and running a request group to the end while watching for the client to go away."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from hybridmoe.engine.sampler import TokenLogprobs
from hybridmoe.engine.sequence import RequestOutput
from hybridmoe.errors import HybridMoEError
from hybridmoe.sampling_params import SamplingParams, StructuredOutput
from hybridmoe.server.async_engine import AsyncEngine, EngineError, RequestStream
from hybridmoe.server.protocol import INVALID_UNICODE, SamplingRequest
from hybridmoe.tokenizer import Tokenizer

MAX_BODY_BYTES = 32 * 1024 * 1024

PROMPT_THREADS = 2
"""Threads that render chat templates and tokenize prompts, off the event loop."""

T = TypeVar("T", bound=BaseModel)


class APIError(Exception):
    """An answer other than success, with OpenAI's error fields."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class ClientGoneError(Exception):
    """The client closed the connection before its answer was ready."""


@dataclass
class ServerState:
    engine: AsyncEngine
    model_name: str
    created: int
    api_key: str | None = None
    vocab_size: int = field(init=False)
    prompt_pool: ThreadPoolExecutor = field(init=False)
    """Where prompts are rendered and tokenized (see prompts.py)."""

    def __post_init__(self):
        self.vocab_size = self.engine.engine.vocab_size
        self.prompt_pool = ThreadPoolExecutor(PROMPT_THREADS, thread_name_prefix="hybridmoe-prompt")

    def close(self) -> None:
        self.prompt_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def tokenizer(self) -> Tokenizer:
        if self.engine.tokenizer is None:
            raise APIError(400, "this model directory has no tokenizer.json, so text prompts and chat cannot "
                                "be served; send token ids to /v1/completions")
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(400, f"the model {name!r} is not served here; this server serves {self.model_name!r} "
                                f"(see GET /v1/models)", param="model", code="model_not_found")


async def parse_body(request: Request, schema: type[T]) -> T:
    """The JSON body validated against schema: 400 for bad JSON, JSON nested too deeply, text that is not
    valid Unicode or a field of schema.UNSUPPORTED_FIELDS (which would change the answer, so ignoring it would
    look like success); 422 for a wrong field."""
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY_BYTES:
                raise APIError(413, f"the request body is over {MAX_BODY_BYTES // 2**20} MiB")
    except ClientDisconnect:
        raise ClientGoneError() from None
    try:
        data = json.loads(body)
    except RecursionError:
        raise APIError(400, "the request body's JSON is nested too deeply") from None
    except ValueError as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    for name, why in getattr(schema, "UNSUPPORTED_FIELDS", {}).items():
        if data.get(name) not in (None, [], {}):
            raise APIError(400, f"{name} is not supported: {why}", param=name)
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        unicode = [err for err in errors if err["type"] == INVALID_UNICODE]
        first = unicode[0] if unicode else errors[0]
        where = _field_path(first["loc"])
        if unicode:
            raise APIError(400, f"{where}: {first['msg']}", param=where or None, code=INVALID_UNICODE) from None
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise APIError(422, f"{where}: {first['msg']}{more}", param=where or None) from None


def _field_path(loc: tuple) -> str:
    """messages.0.content from pydantic's location, without the union members it names (list[int], ...)."""
    return ".".join(str(p) for p in loc if isinstance(p, int) or "[" not in p)


def request_params(*, max_tokens: int | None, temperature: float | None, top_p: float | None = None,
                   top_k: int | None = None, min_p: float | None = None, presence_penalty: float | None = None,
                   frequency_penalty: float | None = None, repetition_penalty: float | None = None,
                   stop: str | list[str] | None = None, stop_token_ids: list[int] | None = None,
                   ignore_eos: bool = False, logprobs: int | None = None,
                   default_temperature: float = 1.0, structured: StructuredOutput | None = None) -> SamplingParams:
    """A request's SamplingParams, checked before its prompt is read: a value SamplingParams refuses is a
    400 naming the field. max_tokens None stands at 1 until for_prompt fits it to each prompt."""
    return _checked(lambda: SamplingParams(
        max_tokens=1 if max_tokens is None else max_tokens,
        temperature=default_temperature if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=0 if top_k is None or top_k < 0 else top_k,  # -1 disables, as in vLLM
        min_p=min_p or 0.0, presence_penalty=presence_penalty or 0.0,
        frequency_penalty=frequency_penalty or 0.0,
        repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
        stop=stop or [], stop_token_ids=stop_token_ids or [], ignore_eos=ignore_eos, logprobs=logprobs,
        structured=structured))


def openai_params(req: SamplingRequest, max_tokens: int | None, logprobs: int | None,
                  structured: StructuredOutput | None = None) -> SamplingParams:
    """request_params of an OpenAI request (chat or completion); structured: its response_format's grammar."""
    return request_params(structured=structured,
        max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, stop=req.stop, stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos, logprobs=logprobs)


def for_prompt(state: ServerState, params: SamplingParams, prompt_len: int, max_tokens: int | None,
               seed: int | None) -> SamplingParams:
    """params for one sequence of a prompt of prompt_len tokens (checked by prompts.check_prompt_ids, so
    it leaves room): max_tokens checked against that room (None: all of it), and the sequence's seed."""
    room = state.max_model_len - prompt_len
    if max_tokens is None:
        max_tokens = room
    elif max_tokens > room:
        raise APIError(400, f"the prompt has {prompt_len} tokens and max_tokens is {max_tokens}: together "
                            f"{prompt_len + max_tokens}, over the model's context of {state.max_model_len} tokens; "
                            f"shorten the prompt or lower max_tokens", param="max_tokens",
                       code="context_length_exceeded")
    return _checked(lambda: dataclasses.replace(params, max_tokens=max_tokens,
                                                seed=None if seed is None else seed % 2**64))


def _checked(build) -> SamplingParams:
    try:
        return build()
    except HybridMoEError as e:
        raise APIError(400, str(e)) from None


def token_text(state: ServerState, token_id: int) -> str:
    """One token as text, special tokens included (a piece of a UTF-8 character reads as U+FFFD)."""
    return state.tokenizer.decode([token_id], skip_special_tokens=False)


def seed_for(seed: int | None, index: int) -> int | None:
    """The n choices of one seeded request get seeds seed, seed+1, ...: reproducible, not equal."""
    return None if seed is None else seed + index


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client has gone (the body has already been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


@dataclass
class Finished:
    output: RequestOutput
    """The request's last output: its whole text and token ids."""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    """Of every generated token, when asked for."""


async def collect(stream: RequestStream, request: Request) -> dict[int, Finished]:
    """Every request of the group run to its end, by index. A client that goes away meanwhile
    aborts the group (ClientGoneError)."""
    finals: dict[int, Finished] = {}
    logprobs: dict[int, list[TokenLogprobs]] = {}

    async def consume():
        async for index, out in stream:
            logprobs.setdefault(index, []).extend(out.new_logprobs or [])
            if out.finished:
                finals[index] = Finished(out, logprobs.pop(index))

    consumer = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not consumer.done():
            consumer.cancel()
        stream.close()
    if not consumer.done() or consumer.cancelled():
        raise ClientGoneError()
    consumer.result()  # an engine error surfaces here
    return finals


def error_event(e: Exception) -> str:
    """An error after the stream began (its headers are sent): an SSE event with OpenAI's error JSON."""
    if isinstance(e, HybridMoEError):
        err = APIError(400, str(e))
    elif isinstance(e, EngineError):
        err = APIError(500, str(e), type_="server_error")
    else:
        err = APIError(500, f"the server failed: {e}", type_="server_error")
    return sse(json.dumps(err.body()))


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"
