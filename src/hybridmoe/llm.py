"""The offline API: `LLM(model_dir).generate(prompts, SamplingParams(...))`, `stream`, `chat`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from hybridmoe.config import EngineConfig
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.engine.sequence import RequestOutput
from hybridmoe.errors import HybridMoEError
from hybridmoe.sampling_params import SamplingParams
from hybridmoe.tokenizer import Tokenizer

Prompt = str | list[int]


class LLM:
    """A model loaded for generation. engine_config: any EngineConfig field (max_num_seqs=...).

    With tensor_parallel_size=N > 1 it starts N - 1 worker processes (distributed/); close() (or a with block, or
    the LLM's garbage collection) stops them."""

    def __init__(self, model_dir: str | Path, dtype: str = "auto", **engine_config):
        self.engine = LLMEngine(model_dir, EngineConfig.from_kwargs(dtype=dtype, **engine_config))

    def close(self) -> None:
        """Stop the engine's worker processes, if any; the LLM generates nothing after."""
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def encode(self, prompt: Prompt) -> list[int]:
        """A prompt as token ids: text goes through the tokenizer, token ids pass as they are."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise HybridMoEError("this model directory has no tokenizer.json, so text prompts cannot "
                                     "be encoded; pass token ids instead")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        raise HybridMoEError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs) -> list[int]:
        """A conversation through the model's chat template, as token ids."""
        if self.tokenizer is None:
            raise HybridMoEError("this model directory has no tokenizer, so there is no chat template")
        return self.tokenizer.encode_chat(messages, add_generation_prompt, **template_kwargs)

    def generate(self, prompts: Prompt | list[Prompt],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """One finished output per prompt, in order. prompts: a string, token ids, or a list of either."""
        if not isinstance(prompts, list) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise HybridMoEError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        return self._run([self.encode(p) for p in prompts], params)

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None,
             **template_kwargs) -> list[RequestOutput]:
        """The assistant's reply to a conversation (or to each of a list of conversations)."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        ids = [self.encode_chat(c, **template_kwargs) for c in conversations]
        return self._run(ids, [params or SamplingParams()] * len(ids))

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Outputs as tokens arrive: each has new_token_ids and new_text (the increments).

        Closing the iterator early (break, Ctrl-C) aborts the request and frees its slot.
        """
        engine = self.engine
        request_id = engine.add_request(self.encode(prompt), params)
        finished = False
        try:
            while not finished:
                for out in engine.step():
                    if out.request_id == request_id:
                        finished = out.finished
                        yield out
        finally:
            if not finished:
                engine.abort(request_id)

    def _run(self, prompt_ids: list[list[int]], params: list[SamplingParams]) -> list[RequestOutput]:
        engine = self.engine
        order = []
        try:
            for ids, p in zip(prompt_ids, params):
                order.append(engine.add_request(ids, p))
            wanted = set(order)
            results: dict[str, RequestOutput] = {}
            while len(results) < len(order):
                for out in engine.step():
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = out
        finally:
            for request_id in order:  # after an error or Ctrl-C, nothing is left behind in the engine
                engine.abort(request_id)
        return [results[r] for r in order]
