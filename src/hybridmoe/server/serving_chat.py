"""POST /v1/chat/completions: the conversation through the chat template, n choices, streamed as
OpenAI frames chat.completion.chunk events or answered at once."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from hybridmoe.engine.sampler import TokenLogprobs
from hybridmoe.server.prompts import encode_chat
from hybridmoe.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
    random_id,
)
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
from hybridmoe.server.structured import check_structured, structured_of


async def chat_prompt(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                for m in req.messages]
    return await encode_chat(state, messages)


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request) -> Response:
    state.check_model(req.model)
    refuse_unbuilt(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    structured = structured_of(req.response_format)
    params = openai_params(req, max_tokens, logprobs, structured)
    await check_structured(state, structured)
    state.engine.check_capacity(req.n)
    prompt_ids = await chat_prompt(state, req)
    group = [(prompt_ids, for_prompt(state, params, len(prompt_ids), max_tokens, seed_for(req.seed, i)))
             for i in range(req.n)]
    request_id = random_id("chatcmpl")
    stream = state.engine.submit(request_id, group)
    if req.stream:
        return StreamingResponse(_chunks(state, req, request_id, len(prompt_ids), stream),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    finals = await collect(stream, request)
    response = ChatCompletionResponse(
        id=request_id, model=state.model_name,
        choices=[ChatChoice(index=i, message=AssistantMessage(content=f.output.text),
                            logprobs=_logprobs(state, f.logprobs) if req.logprobs else None,
                            finish_reason=f.output.finish_reason) for i, f in sorted(finals.items())],
        usage=UsageInfo.of(len(prompt_ids), sum(len(f.output.token_ids) for f in finals.values()),
                           finals[0].output.num_cached_tokens))
    return JSONResponse(response.model_dump(mode="json"))


def refuse_unbuilt(req: ChatCompletionRequest) -> None:
    """A 400 for what the server does not do yet: tool calls (tools, or a tool_choice that needs one);
    answering such a request in plain text would look like success."""
    if req.tools:
        raise APIError(400, "tool calls are not supported yet: the reply would be plain text; send the request "
                            "without tools", param="tools")
    if req.tool_choice not in (None, "none", "auto"):
        raise APIError(400, "tool_choice needs tool calls, which are not supported yet", param="tool_choice")


async def _chunks(state: ServerState, req: ChatCompletionRequest, request_id: str, prompt_len: int,
                  stream) -> AsyncIterator[str]:
    created = int(time.time())
    include_usage = req.include_usage

    def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> str:
        c = ChatCompletionChunk(id=request_id, created=created, model=state.model_name, choices=choices,
                                usage=usage)
        return sse(c.model_dump_json(exclude=None if include_usage else {"usage"}))

    completion_tokens, cached_tokens = 0, 0
    try:
        for i in range(req.n):
            yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
        try:
            async for i, out in stream:
                completion_tokens += len(out.new_token_ids)
                cached_tokens = out.num_cached_tokens if i == 0 else cached_tokens  # the prompt's, as choice 0 found
                if out.new_text or out.new_logprobs:
                    yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(content=out.new_text),
                                                 logprobs=_logprobs(state, out.new_logprobs) if req.logprobs
                                                 else None)])
                if out.finished:
                    yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(), finish_reason=out.finish_reason)])
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

