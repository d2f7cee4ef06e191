"""Anthropic's Messages API on the same engine: POST /v1/messages (one JSON message, or Anthropic's SSE events
when streamed) and POST /v1/messages/count_tokens, so Anthropic clients and agents work against a local model.

A request becomes the chat route's input (anthropic_chat.py: the messages the template renders, the tool plan
of tool_choice.py) and the answer, read by chat_output.py as the chat route reads it, becomes content blocks
(anthropic_blocks.py: thinking, text and tool_use). Every failure of these routes, a body that fails
validation included, is answered in Anthropic's error JSON with Anthropic's status for it (answer_errors),
while the OpenAI routes keep OpenAI's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from hybridmoe.engine.sequence import RequestOutput
from hybridmoe.errors import HybridMoEError
from hybridmoe.sampling_params import SamplingParams
from hybridmoe.server.anthropic_blocks import ContentBlocks, answer_blocks
from hybridmoe.server.anthropic_chat import chat_input
from hybridmoe.server.anthropic_protocol import (
    AnthropicUsage,
    ConversationRequest,
    MessagesRequest,
    MessagesResponse,
    StopReason,
    TokenCount,
    message_id,
)
from hybridmoe.server.async_engine import EngineError, QueueFullError
from hybridmoe.server.chat_output import ChatOutputFormat
from hybridmoe.server.prompts import encode_chat, render_chat
from hybridmoe.server.reasoning import reasoning_parser
from hybridmoe.server.serving_common import (
    APIError,
    ClientGoneError,
    ServerState,
    collect,
    for_prompt,
    parse_body,
    request_params,
    sse,
)
from hybridmoe.server.structured import check_structured, reasoning_closed_first
from hybridmoe.server.tool_choice import marker_for, reading_markup

log = logging.getLogger("hybridmoe.server")

ANTHROPIC_PATH = "/v1/messages"
"""The path of the Anthropic routes, and the start of the others' (/v1/messages/count_tokens)."""

OVERLOADED = 529
"""Anthropic's status for a server too busy to take the request now (its clients retry it)."""
RETRY_AFTER_SECONDS = 1

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
               OVERLOADED: "overloaded_error"}
"""Anthropic's error type of each status; any other 4xx is an invalid_request_error, any 5xx an api_error."""


async def create_message(state: ServerState, request: Request) -> Response:
    """POST /v1/messages."""
    return await answer_errors(_create_message(state, request))


async def count_tokens(state: ServerState, request: Request) -> Response:
    """POST /v1/messages/count_tokens: the prompt's length in tokens, the conversation rendered as
    /v1/messages renders it (so also a 400 for a conversation that leaves no room in the context)."""
    return await answer_errors(_count_tokens(state, request))


async def _create_message(state: ServerState, request: Request) -> Response:
    req = await parse_body(request, MessagesRequest)
    state.check_model(req.model)
    refuse_unbuilt(req)
    template = state.tokenizer.chat_template
    chat = chat_input(template, req, marker_for(state.tokenizer))
    params = request_params(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                            top_k=req.top_k, stop=req.stop_sequences, structured=chat.plan.structured)
    params = reading_markup(params, chat.plan.parser, template)
    await check_structured(state, chat.plan.structured, "tools")
    state.engine.check_capacity()
    text, prompt_ids = await render_chat(state, chat.messages, **chat.plan.template_kwargs)
    params = reasoning_closed_first(params, template, text, marker_for(state.tokenizer))
    output = ChatOutputFormat(chat.plan.parser, reasoning_parser(template, text))
    params = for_prompt(state, params, len(prompt_ids), req.max_tokens, seed=req.seed)
    msg_id = message_id()
    stream = state.engine.submit(msg_id, [(prompt_ids, params)])
    if req.stream:
        blocks = ContentBlocks(chat.plan.parallel)
        return StreamingResponse(_events(state, params, msg_id, len(prompt_ids), stream, output, blocks),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    out = (await collect(stream, request))[0].output
    blocks = answer_blocks(output, out.text, chat.plan.parallel)
    reason, sequence = stop_reason(state, out, params, blocks.called)
    response = MessagesResponse(id=msg_id, content=blocks.blocks, model=state.model_name,
                                stop_reason=reason, stop_sequence=sequence,
                                usage=AnthropicUsage.of(len(prompt_ids), len(out.token_ids), out.num_cached_tokens))
    return JSONResponse(response.model_dump(mode="json"))


async def _count_tokens(state: ServerState, request: Request) -> Response:
    req = await parse_body(request, ConversationRequest)
    state.check_model(req.model)
    refuse_unbuilt(req)
    chat = chat_input(state.tokenizer.chat_template, req, marker_for(state.tokenizer))
    prompt_ids = await encode_chat(state, chat.messages, **chat.plan.template_kwargs)
    return JSONResponse(TokenCount(input_tokens=len(prompt_ids)).model_dump(mode="json"))


def refuse_unbuilt(req: ConversationRequest) -> None:
    """A 400 for what the server does not do yet: structured output (output_config.format); answering such a
    request in free text would look like success."""
    if req.output_config is not None and req.output_config.get("format") is not None:
        raise APIError(400, "output_config.format: structured output is not supported yet: the reply would not "
                            "be held to the format", param="output_config.format")


def stop_reason(state: ServerState, out: RequestOutput, params: SamplingParams, called: bool
                ) -> tuple[StopReason, str | None]:
    """Why the answer ended, as Anthropic says it, and the stop sequence that ended it; "tool_use" for an
    answer that ended on its own (EOS) with calls in it (called).

    The engine's "stop" covers the end of the turn (EOS) and a stop string alike, and its text stops before
    the stop string; so the output tokens are decoded again as the engine decoded them (work in proportion to
    what was generated) and the sequence that follows the text is the one found. An answer whose last token
    is an EOS ended on its own: the engine does not decode that token, so no stop string ends in it."""
    if out.finish_reason == "length":
        return "max_tokens", None
    end_turn = ("tool_use" if called else "end_turn"), None
    ids = out.token_ids
    if not params.stop or out.finish_reason != "stop" or (ids and ids[-1] in state.engine.engine.eos_token_ids):
        return end_turn
    rest = state.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens).removeprefix(out.text)
    found = [(at, i) for i, s in enumerate(params.stop) if (at := rest.find(s)) >= 0]
    if not found:
        return end_turn
    return "stop_sequence", params.stop[min(found)[1]]


async def _events(state: ServerState, params: SamplingParams, msg_id: str, prompt_len: int, stream,
                  output: ChatOutputFormat, blocks: ContentBlocks) -> AsyncIterator[str]:
    """Anthropic's stream: message_start, ping, each block's content_block_start, its deltas and its
    content_block_stop (ContentBlocks), message_delta (why it stopped, the usage), message_stop. message_start
    waits for the engine's first output, which says how much of the prompt the prefix cache held (its usage
    reports it)."""
    reader, last = output.stream(), None
    try:
        try:
            async for _, out in stream:
                if last is None:
                    start = MessagesResponse(id=msg_id, content=[], model=state.model_name, stop_reason=None,
                                             stop_sequence=None,
                                             usage=AnthropicUsage.of(prompt_len, 0, out.num_cached_tokens))
                    yield _event("message_start", {"type": "message_start", "message": start.model_dump(mode="json")})
                    yield _event("ping", {"type": "ping"})
                for event in blocks.feed(reader.feed(out.new_text) + (reader.finish() if out.finished else [])):
                    yield _event(event["type"], event)
                last = out
        except Exception as e:  # noqa: BLE001 (the headers are sent: any error travels as an event)
            yield _event("error", error_body(e)[1])
            return
        for event in blocks.finish():
            yield _event(event["type"], event)
        reason, sequence = stop_reason(state, last, params, blocks.called)
        usage = AnthropicUsage.of(prompt_len, len(last.token_ids), last.num_cached_tokens)
        yield _event("message_delta", {"type": "message_delta",
                                       "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                       "usage": usage.model_dump(mode="json")})
        yield _event("message_stop", {"type": "message_stop"})
    finally:
        stream.close()


def _event(name: str, data: dict) -> str:
    return f"event: {name}\n" + sse(json.dumps(data))


async def answer_errors(work: Awaitable[Response]) -> Response:
    """work's response, or its failure as Anthropic's error JSON (a client gone stays the app's concern)."""
    try:
        return await work
    except ClientGoneError:
        raise
    except Exception as e:  # noqa: BLE001 (every failure of these routes is answered in Anthropic's JSON)
        status, body = error_body(e)
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if status == OVERLOADED else None
        return JSONResponse(body, status_code=status, headers=headers)


def error_body(e: Exception) -> tuple[int, dict]:
    """(status, {"type": "error", "error": {"type", "message"}}) of a failure, as Anthropic answers it: a body
    that fails validation is a 400, a model not served here a 404, a full queue a 529 (overloaded)."""
    if isinstance(e, APIError):
        status = 404 if e.code == "model_not_found" else 400 if e.status == 422 else e.status
        message = e.message
    elif isinstance(e, QueueFullError):
        status, message = OVERLOADED, str(e)
    elif isinstance(e, HybridMoEError):
        status, message = 400, str(e)
    elif isinstance(e, EngineError):
        status, message = 500, str(e)
    else:
        log.exception("request failed", exc_info=e)
        status, message = 500, f"the server failed: {type(e).__name__}: {e}"
    type_ = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return status, {"type": "error", "error": {"type": type_, "message": message}}
