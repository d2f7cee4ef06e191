"""POST /v1/completions: one prompt or a batch (strings or token ids), n choices each, streamed as
OpenAI frames text_completion events or answered at once. Choice index = prompt * n + choice."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from itertools import accumulate

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from hybridmoe.engine.sampler import TokenLogprobs
from hybridmoe.server.prompts import check_prompt_ids, encode_text
from hybridmoe.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
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


def prompt_list(prompt) -> list[str | list[int]]:
    """The prompt field as a list of prompts, each a string or token ids."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is an empty list; give a string, token ids, or a list of either",
                       param="prompt")
    return list(prompt)


async def completion_prompts(state: ServerState, prompts: list[str | list[int]]) -> list[list[int]]:
    """Each prompt as checked token ids."""
    ids = []
    for p in prompts:
        if isinstance(p, str):
            ids.append(await encode_text(state, p))
        else:
            check_prompt_ids(state, p)
            ids.append(p)
    return ids


async def create_completion(state: ServerState, req: CompletionRequest, request: Request) -> Response:
    state.check_model(req.model)
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo with logprobs (log-probabilities of the prompt) is not supported; "
                            "drop one of them", param="logprobs")
    if req.suffix:
        raise APIError(400, "suffix (fill-in-the-middle) is not supported; put the text in the prompt",
                       param="suffix")
    structured = structured_of(req.response_format)
    params = openai_params(req, req.max_tokens, req.logprobs, structured)
    await check_structured(state, structured)
    texts = prompt_list(req.prompt)
    state.engine.check_capacity(len(texts) * req.n)
    prompts = await completion_prompts(state, texts)
    group = [(ids, for_prompt(state, params, len(ids), req.max_tokens, seed_for(req.seed, i)))
             for ids in prompts for i in range(req.n)]
    # echo: the prompt's text comes first (token-id prompts decoded)
    echoes = [state.tokenizer.decode(ids) if req.echo else "" for ids, _ in group]
    request_id = random_id("cmpl")
    stream = state.engine.submit(request_id, group)
    prompt_tokens = sum(len(p) for p in prompts)
    if req.stream:
        return StreamingResponse(_events(state, req, request_id, prompt_tokens, echoes, stream),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    finals = await collect(stream, request)
    response = CompletionResponse(
        id=request_id, model=state.model_name,
        choices=[CompletionChoice(index=i, text=echoes[i] + f.output.text, finish_reason=f.output.finish_reason,
                                  logprobs=None if req.logprobs is None else _logprobs(state, f.logprobs, 0))
                 for i, f in sorted(finals.items())],
        usage=UsageInfo.of(prompt_tokens, sum(len(f.output.token_ids) for f in finals.values()),
                           sum(finals[p * req.n].output.num_cached_tokens for p in range(len(prompts)))))
    return JSONResponse(response.model_dump(mode="json"))


async def _events(state: ServerState, req: CompletionRequest, request_id: str, prompt_tokens: int,
                  echoes: list[str], stream) -> AsyncIterator[str]:
    created = int(time.time())
    include_usage = req.include_usage

    def event(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
        c = CompletionResponse(id=request_id, created=created, model=state.model_name, choices=choices,
                               usage=usage)
        return sse(c.model_dump_json(exclude=None if include_usage else {"usage"}))

    completion_tokens, cached = 0, {}  # cached: each prompt's cached tokens, as its first choice found them
    offsets = [0] * len(echoes)  # text_offset of each choice's next token
    try:
        for i, echo in enumerate(echoes):
            if echo:
                yield event([CompletionChoice(index=i, text=echo, finish_reason=None)])
        try:
            async for i, out in stream:
                completion_tokens += len(out.new_token_ids)
                if i % req.n == 0:
                    cached[i] = out.num_cached_tokens
                if out.new_text or out.finished or out.new_logprobs:
                    logprobs = None
                    if req.logprobs is not None:
                        logprobs = _logprobs(state, out.new_logprobs or [], offsets[i])
                        offsets[i] += sum(len(t) for t in logprobs.tokens)
                    yield event([CompletionChoice(index=i, text=out.new_text, finish_reason=out.finish_reason,
                                                  logprobs=logprobs)])
        except Exception as e:  # noqa: BLE001 (the headers are sent: any error travels as an event)
            yield error_event(e)
            return
        if include_usage:
            yield event([], UsageInfo.of(prompt_tokens, completion_tokens, sum(cached.values())))
        yield SSE_DONE
    finally:
        stream.close()


def _logprobs(state: ServerState, logprobs: list[TokenLogprobs], offset: int) -> CompletionLogprobs:
    tokens = [token_text(state, lp.token_id) for lp in logprobs]
    starts = list(accumulate(map(len, tokens), initial=offset))[:-1]  # each token's text offset
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=[lp.logprob for lp in logprobs], text_offset=starts,
        top_logprobs=[_by_text(state, lp.top) for lp in logprobs])


def _by_text(state: ServerState, top: list[tuple[int, float]]) -> dict[str, float]:
    # tokens that read alike (pieces of one UTF-8 character all read U+FFFD) keep the likeliest's value
    out: dict[str, float] = {}
    for token_id, logprob in top:
        out.setdefault(token_text(state, token_id), logprob)
    return out

