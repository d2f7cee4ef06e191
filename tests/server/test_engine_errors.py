"""A request the engine ends with finish_reason "error" (it failed alone) fails alone: its stream raises
EngineError with the engine's one-line reason (the app answers 500 server_error, or an error event once a
stream has begun) and the rest of its group is aborted."""

import asyncio
import json

import pytest

from hybridmoe.config import EngineConfig
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.engine.sequence import RequestOutput
from hybridmoe.server.async_engine import AsyncEngine, EngineError, RequestStream
from hybridmoe.server.serving_common import error_event

WHY = "sampling row 0 failed: the logits hold NaN"


@pytest.fixture(scope="module")
def async_engine(tiny_qwen3_fp32):
    return AsyncEngine(LLMEngine(tiny_qwen3_fp32, EngineConfig.from_kwargs(device="cpu", dtype="float32")),
                       max_queue=0)


def _output(request_id: str, finish_reason: str | None, error: str | None = None) -> RequestOutput:
    return RequestOutput(request_id=request_id, prompt_token_ids=[1], token_ids=[5], text="a", new_token_ids=[5],
                         new_text="a", finish_reason=finish_reason, error=error)


async def _run(engine: AsyncEngine) -> tuple[RequestStream, list, EngineError]:
    outputs: asyncio.Queue = asyncio.Queue()
    stream = RequestStream(engine, ["r-0", "r-1"], outputs)
    outputs.put_nowait((1, _output("r-1", None)))  # the engine's outputs, as its thread delivers them
    outputs.put_nowait((0, _output("r-0", "error", WHY)))
    seen = [await stream.__anext__()]
    with pytest.raises(EngineError) as e:
        await stream.__anext__()
    return stream, seen, e.value


def test_an_error_output_raises_engine_error_and_ends_the_group(async_engine):
    stream, seen, error = asyncio.run(_run(async_engine))
    assert [index for index, _ in seen] == [1]  # what came before the error was delivered
    assert str(error) == f"the engine failed on this request: {WHY}"
    assert stream.finished  # r-1, still running, was aborted with it


def test_the_error_event_is_openai_error_json():
    event = error_event(EngineError(f"the engine failed on this request: {WHY}"))
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert json.loads(event.removeprefix("data: "))["error"] == {
        "message": f"the engine failed on this request: {WHY}", "type": "server_error", "param": None,
        "code": None}
