"""The bridge between asyncio request handlers and the LLMEngine, which is not thread-safe.

One engine thread owns the engine. Handlers send it commands (add, abort) through a queue; it
runs them between steps, steps while any request is unfinished, and hands each RequestOutput
to its request's asyncio.Queue on the event loop. So concurrent requests share every step
(continuous batching), a request joins at the next step, and one cancelled by its handler (a
client gone mid-stream) is aborted before the next step, which frees its slot at once.

Admission is decided on the event loop: requests in flight are capped at the batch size plus
`max_queue`; past that, submit() raises QueueFullError (HTTP 429, busy now), and a group larger than
that cap, which can never fit, a HybridMoEError (HTTP 400). A request the engine ends with
finish_reason "error" (it failed alone) raises EngineError from its stream.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass

from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.engine.sequence import RequestOutput
from hybridmoe.errors import HybridMoEError
from hybridmoe.sampling_params import SamplingParams
from hybridmoe.server.metrics import Metrics

log = logging.getLogger("hybridmoe.server")


class QueueFullError(Exception):
    """More requests are waiting than the server accepts; the client should retry later."""


class EngineError(Exception):
    """The engine failed while running this request (a bug, not the client's fault); the message is one line."""


@dataclass
class _Tracked:
    """A request as the engine thread sees it: where its outputs go, and its timings."""

    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    index: int
    arrival: float
    last_token_time: float | None = None

    def deliver(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.outputs.put_nowait, (self.index, item))
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass


class RequestStream:
    """The outputs of a group of requests submitted together (n choices, several prompts), as
    (index in the group, RequestOutput) in the order the engine made them. close() aborts what
    is still running; use it in a finally block so that a client gone frees its slots."""

    def __init__(self, engine: AsyncEngine, request_ids: list[str], outputs: asyncio.Queue):
        self._engine = engine
        self.request_ids = request_ids
        self._outputs = outputs
        self._unfinished = set(range(len(request_ids)))

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self._unfinished:
            raise StopAsyncIteration
        index, item = await self._outputs.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        if item.finished:
            self._unfinished.discard(index)
            self._engine._release([self.request_ids[index]], abort=False)
        if item.finish_reason == "error":
            self.close()
            raise EngineError(f"the engine failed on this request: {item.error}")
        return index, item

    def close(self) -> None:
        """Abort every request of the group that has not finished (idempotent)."""
        if self._unfinished:
            self._engine._release([self.request_ids[i] for i in self._unfinished], abort=True)
            self._unfinished.clear()


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queue: int, metrics: Metrics | None = None):
        if max_queue < 0:
            raise HybridMoEError(f"max_queue must be at least 0, got {max_queue}")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.max_running = engine.config.max_num_seqs
        self.max_queue = max_queue
        self.metrics = metrics or Metrics()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._in_flight: set[str] = set()  # event loop only
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="hybridmoe-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._commands.put(("wake",))
        self._thread.join(timeout=30)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def check_capacity(self, n: int = 1) -> None:
        """Raise QueueFullError unless n more requests fit in the batch plus the queue now, and a
        HybridMoEError when they never can."""
        if n > self.max_running + self.max_queue:
            raise HybridMoEError(
                f"this request needs {n} sequences at once (prompts x n), more than this server ever holds: "
                f"{self.max_running} running and {self.max_queue} waiting; send fewer prompts or a lower n")
        if len(self._in_flight) + n > self.max_running + self.max_queue:
            raise QueueFullError(
                f"the server is busy: {len(self._in_flight)} requests in flight, room for "
                f"{self.max_running} running and {self.max_queue} waiting; retry shortly")

    def submit(self, request_id: str, prompts: list[tuple[list[int], SamplingParams]]) -> RequestStream:
        """Queue a group of requests (prompt ids, params) for the engine; call from the event loop.

        Raises QueueFullError when the group does not fit in the batch plus the queue."""
        self.check_capacity(len(prompts))
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        if any(i in self._in_flight for i in ids):
            raise HybridMoEError(f"request id {request_id!r} is already in use")
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        now = time.perf_counter()
        for index, (sub_id, (prompt_ids, params)) in enumerate(zip(ids, prompts)):
            self._in_flight.add(sub_id)
            self._commands.put(("add", sub_id, prompt_ids, params, _Tracked(loop, outputs, index, now)))
        return RequestStream(self, ids, outputs)

    def _release(self, request_ids: list[str], abort: bool) -> None:
        for request_id in request_ids:
            self._in_flight.discard(request_id)
            if abort:
                self._commands.put(("abort", request_id))

    def _run(self) -> None:
        engine = self.engine
        while not self._stopping:
            self._run_commands(block=not engine.has_unfinished())
            if not engine.has_unfinished():
                continue
            start = time.perf_counter()
            try:
                outputs = engine.step()
            except Exception as e:  # a bug: fail the requests in the engine, keep the server up for new ones
                log.exception("engine step failed")
                self._fail_all(EngineError(f"the engine failed: {type(e).__name__}: {e}"))
                continue
            now = time.perf_counter()
            self._record_step(now - start, outputs, now)
            for out in outputs:
                self._deliver(out, now)
            self._update_gauges()

    def _run_commands(self, block: bool) -> None:
        while True:
            try:
                cmd = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
            except queue.Empty:
                return
            block = False
            if cmd[0] == "add":
                _, request_id, prompt_ids, params, tracked = cmd
                try:
                    self.engine.add_request(prompt_ids, params, request_id)
                except HybridMoEError as e:
                    tracked.deliver(e)
                    continue
                self._tracked[request_id] = tracked
                self.metrics.prompt_tokens.inc(amount=len(prompt_ids))
            elif cmd[0] == "abort" and self._tracked.pop(cmd[1], None) is not None:
                self.engine.abort(cmd[1])
                self.metrics.requests_finished.inc("abort")
            self._update_gauges()

    def _deliver(self, out: RequestOutput, now: float) -> None:
        tracked = self._tracked.get(out.request_id)
        if tracked is None:
            return
        if tracked.last_token_time is None:
            self.metrics.time_to_first_token.observe(now - tracked.arrival)
        else:
            self.metrics.inter_token_latency.observe(now - tracked.last_token_time)
        tracked.last_token_time = now
        if out.finished:
            del self._tracked[out.request_id]
            self.metrics.requests_finished.inc(out.finish_reason)
        tracked.deliver(out)

    def _record_step(self, seconds: float, outputs: list[RequestOutput], now: float) -> None:
        m = self.metrics
        m.engine_steps.inc()
        m.step_time.observe(seconds)
        if outputs:
            m.batch_size.observe(len(outputs))
            m.generation_tokens.inc(amount=sum(len(o.new_token_ids) for o in outputs))

    def _fail_all(self, error: Exception) -> None:
        for request_id, tracked in self._tracked.items():
            self.engine.abort(request_id)
            self.metrics.requests_finished.inc("error")
            tracked.deliver(error)
        self._tracked.clear()
        self._update_gauges()

    def _update_gauges(self) -> None:
        scheduler, m = self.engine.scheduler, self.metrics
        m.requests_running.set(len(scheduler.running))
        m.requests_waiting.set(len(scheduler.waiting))
        pool = scheduler.pool
        m.kv_cache_usage.set(1.0 - pool.num_free / pool.usable_blocks)
        # the counters follow the scheduler's own totals
        m.prefix_cache_queries.inc(amount=pool.stats.queried_tokens - m.prefix_cache_queries.value())
        m.prefix_cache_hits.inc(amount=pool.stats.hit_tokens - m.prefix_cache_hits.value())
        m.prefix_cache_hit_rate.set(pool.stats.hit_rate)
        m.preemptions.inc(amount=scheduler.num_preemptions - m.preemptions.value())
