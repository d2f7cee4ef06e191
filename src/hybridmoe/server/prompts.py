"""A request's prompts as checked token ids, the work bounded before it is done.

Raw lengths come first: a text longer than the context could hold at MAX_CHARS_PER_TOKEN characters a
token, as many messages as the context has tokens, or token ids that leave no room for a new token is a
400 before anything is rendered or tokenized. The chat template and the tokenizer then run on the
server's prompt threads (ServerState.prompt_pool), so the event loop, /health included, answers meanwhile.
"""

from __future__ import annotations

import asyncio
import functools

from hybridmoe.errors import HybridMoEError
from hybridmoe.server.serving_common import APIError, ServerState
from hybridmoe.tokenizer import Tokenizer

MAX_CHARS_PER_TOKEN = 32
"""Most characters a token of a prompt stands for, on average over the prompt. Text averages 3 to 5, and
only a prompt made of nothing but long runs of spaces or symbols comes near 32; so a text longer than
max_model_len * 32 characters is refused untokenized, as one that cannot fit the context."""


def max_prompt_chars(state: ServerState) -> int:
    return state.max_model_len * MAX_CHARS_PER_TOKEN


def check_text_length(state: ServerState, chars: int, what: str, param: str) -> None:
    limit = max_prompt_chars(state)
    if chars > limit:
        raise APIError(400, f"{what} has {chars} characters, more than a context of {state.max_model_len} tokens "
                            f"holds: at most {limit} ({MAX_CHARS_PER_TOKEN} a token); shorten it",
                       param=param, code="context_length_exceeded")


def check_prompt_ids(state: ServerState, ids: list[int], param: str = "prompt") -> None:
    """A prompt that leaves room for a token in the context, of ids in the vocabulary; its length first."""
    if not ids:
        raise APIError(400, "the prompt is empty; give at least one token", param=param)
    if len(ids) >= state.max_model_len:
        raise APIError(400, f"the prompt has {len(ids)} tokens, which leaves no room in the context of "
                            f"{state.max_model_len} tokens; shorten it", param=param, code="context_length_exceeded")
    bad = next((t for t in ids if not 0 <= t < state.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"prompt token id {bad} is outside the vocabulary [0, {state.vocab_size})",
                       param=param)


async def encode_text(state: ServerState, text: str, param: str = "prompt") -> list[int]:
    """A plain text prompt as checked token ids (special tokens added as the tokenizer does)."""
    check_text_length(state, len(text), "the prompt", param)
    ids = await off_loop(state, state.tokenizer.encode, text)
    check_prompt_ids(state, ids, param)
    return ids


async def encode_chat(state: ServerState, messages: list[dict], **template_kwargs) -> list[int]:
    """A conversation through the model's chat template, as checked prompt token ids."""
    return (await render_chat(state, messages, **template_kwargs))[1]


async def render_chat(state: ServerState, messages: list[dict], **template_kwargs) -> tuple[str, list[int]]:
    """A conversation through the model's chat template (template_kwargs: tools, enable_thinking, ...): the
    prompt's text and its checked token ids."""
    if len(messages) >= state.max_model_len:
        raise APIError(400, f"messages holds {len(messages)} messages, more than a context of "
                            f"{state.max_model_len} tokens holds", param="messages", code="context_length_exceeded")
    chars = sum(len(m.get("content") or "") + len(m.get("name") or "") for m in messages)
    check_text_length(state, chars, "the conversation", "messages")
    text, ids = await off_loop(state, _render_and_encode, state, state.tokenizer, messages, template_kwargs)
    check_prompt_ids(state, ids, "messages")
    return text, ids


def _render_and_encode(state: ServerState, tokenizer: Tokenizer, messages: list[dict],
                       template_kwargs: dict) -> tuple[str, list[int]]:
    try:
        text = tokenizer.apply_chat_template(messages, **template_kwargs)
    except HybridMoEError as e:
        raise APIError(400, str(e), param="messages") from None
    check_text_length(state, len(text), "the conversation through the chat template", "messages")
    # The template writes BOS itself when the model wants one, so no special tokens here.
    return text, tokenizer.encode(text, add_special_tokens=False)


async def off_loop(state: ServerState, fn, *args):
    """fn(*args) on a prompt thread, counted by the prompts_preparing gauge (set on the event loop only)."""
    preparing = state.engine.metrics.prompts_preparing
    preparing.set(preparing.value + 1)
    try:
        return await asyncio.get_running_loop().run_in_executor(state.prompt_pool, functools.partial(fn, *args))
    finally:
        preparing.set(preparing.value - 1)
