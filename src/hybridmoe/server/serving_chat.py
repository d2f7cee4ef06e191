"""POST /v1/chat/completions: the conversation through the chat template, n choices, streamed as
OpenAI frames chat.completion.chunk events or answered at once."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from hybridmoe.engine.sampler import TokenLogprobs
from hybridmoe.server.chat_output import ChatOutputFormat, delta_message, tool_calls_out
from hybridmoe.server.prompts import render_chat
from hybridmoe.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChoiceLogprobs,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
    random_id,
)
from hybridmoe.server.reasoning import reasoning_parser
from hybridmoe.server.serving_common import (
    SSE_DONE,
    APIError,
    ServerState,
    collect,
    error_event,
    for_prompt,
    openai_params,
    seed_for,
    sse,
    token_text,
)
from hybridmoe.server.structured import check_structured, reasoning_closed_first, structured_of
from hybridmoe.server.tool_choice import marker_for, plan_tools, reading_markup
from hybridmoe.server.tool_parsers import Delta


def message_dict(m: ChatMessage) -> dict:
    """A request message as the chat template reads it (HF's layout): a call's arguments as the object they
    encode when they parse as one (templates write them with tojson), else as the text sent."""
    d = {"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
    if m.tool_calls:
        d["tool_calls"] = [{"id": c.id, "type": "function",
                            "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                           for c in m.tool_calls]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    return d


def _arguments(text: str):
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request) -> Response:
    state.check_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    plan = plan_tools(state.tokenizer.chat_template, req, marker_for(state.tokenizer))
    structured = structured_of(req.response_format)
    if structured is not None and plan.structured is not None:
        raise APIError(400, "response_format and a tool_choice that forces calls cannot both hold the output; "
                            "drop one", param="response_format")
    structured = structured or plan.structured
    params = openai_params(req, max_tokens, logprobs, structured)
    params = reading_markup(params, plan.parser, state.tokenizer.chat_template)
    await check_structured(state, structured, "response_format" if plan.structured is None else "tools")
    state.engine.check_capacity(req.n)
    text, prompt_ids = await render_chat(state, [message_dict(m) for m in req.messages], **plan.template_kwargs)
    params = reasoning_closed_first(params, state.tokenizer.chat_template, text, marker_for(state.tokenizer))
    output = ChatOutputFormat(plan.parser, reasoning_parser(state.tokenizer.chat_template, text))
    group = [(prompt_ids, for_prompt(state, params, len(prompt_ids), max_tokens, seed_for(req.seed, i)))
             for i in range(req.n)]
    request_id = random_id("chatcmpl")
    stream = state.engine.submit(request_id, group)
    if req.stream:
        return StreamingResponse(_chunks(state, req, request_id, len(prompt_ids), stream, output, plan.parallel),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    finals = await collect(stream, request)
    choices = []
    for i, f in sorted(finals.items()):
        parsed = output.parse(f.output.text)
        calls = parsed.tool_calls if plan.parallel else parsed.tool_calls[:1]
        choices.append(ChatChoice(
            index=i, message=AssistantMessage(content=parsed.content, reasoning_content=parsed.reasoning,
                                              tool_calls=tool_calls_out(calls)),
            logprobs=_logprobs(state, f.logprobs) if req.logprobs else None,
            finish_reason=_finish_reason(f.output.finish_reason, bool(calls))))
    response = ChatCompletionResponse(
        id=request_id, model=state.model_name, choices=choices,
        usage=UsageInfo.of(len(prompt_ids), sum(len(f.output.token_ids) for f in finals.values()),
                           finals[0].output.num_cached_tokens))
    return JSONResponse(response.model_dump(mode="json"))


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" for an answer that ended on its own with calls in it."""
    return "tool_calls" if called and reason == "stop" else reason


async def _chunks(state: ServerState, req: ChatCompletionRequest, request_id: str, prompt_len: int,
                  stream, output: ChatOutputFormat, parallel: bool) -> AsyncIterator[str]:
    created = int(time.time())
    include_usage = req.include_usage

    def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
        c = ChatCompletionChunk(id=request_id, created=created, model=state.model_name, choices=choices,
                                usage=usage)
        return sse(c.model_dump_json(exclude=None if include_usage else {"usage"}))

    readers = [output.stream() for _ in range(req.n)]
    called = [False] * req.n
    completion_tokens, cached_tokens = 0, 0
    try:
        for i in range(req.n):
            yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
        try:
            async for i, out in stream:
                completion_tokens += len(out.new_token_ids)
                cached_tokens = out.num_cached_tokens if i == 0 else cached_tokens  # the prompt's, as choice 0 found
                deltas = readers[i].feed(out.new_text) + (readers[i].finish() if out.finished else [])
                deltas = [d for d in deltas if parallel or d.index is None or d.index == 0]
                called[i] = called[i] or any(d.index is not None for d in deltas)
                lp = _logprobs(state, out.new_logprobs) if req.logprobs and out.new_logprobs else None
                for k, d in enumerate(deltas or ([Delta()] if lp else [])):
                    yield chunk([ChatChunkChoice(index=i, delta=delta_message(d), logprobs=lp if k == 0 else None)])
                if out.finished:
                    yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(),
                                                 finish_reason=_finish_reason(out.finish_reason, called[i]))])
        except Exception as e:  # noqa: BLE001 (the headers are sent: any error travels as an event)
            yield error_event(e)
            return
        if include_usage:
            yield chunk([], UsageInfo.of(prompt_len, completion_tokens, cached_tokens))
        yield SSE_DONE
    finally:
        stream.close()


def _logprobs(state: ServerState, logprobs: list[TokenLogprobs]) -> ChoiceLogprobs:
    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(state, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return ChoiceLogprobs(content=[
        TokenLogprob(**entry(lp.token_id, lp.logprob), top_logprobs=[TopLogprob(**entry(t, v)) for t, v in lp.top])
        for lp in logprobs])

