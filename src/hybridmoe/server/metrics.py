"""Prometheus metrics, written in the text exposition format (version 0.0.4) by hand.

The engine thread observes step and token timings, the event loop counts HTTP requests; each
metric takes a lock, so /metrics reads a consistent value of each one.
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict

PREFIX = "hybridmoe_"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _labels(names: tuple[str, ...], values: tuple) -> str:
    if not names:
        return ""
    body = ",".join(f'{n}="{_escape(str(v))}"' for n, v in zip(names, values))
    return "{" + body + "}"


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace('"', r"\"").replace("\n", r"\n")


def _number(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


class Counter:
    def __init__(self, name: str, help_text: str, labels: tuple[str, ...] = ()):
        self.name, self.help, self.label_names = PREFIX + name, help_text, labels
        self._values: dict[tuple, float] = defaultdict(float)
        self._lock = threading.Lock()

    def inc(self, *labels, amount: float = 1.0) -> None:
        with self._lock:
            self._values[labels] += amount

    def value(self, *labels) -> float:
        with self._lock:
            return self._values.get(labels, 0.0)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        with self._lock:
            items = sorted(self._values.items()) or ([((), 0.0)] if not self.label_names else [])
        lines += [f"{self.name}{_labels(self.label_names, k)} {_number(v)}" for k, v in items]
        return lines


class Gauge:
    def __init__(self, name: str, help_text: str):
        self.name, self.help = PREFIX + name, help_text
        self.value = 0

    def set(self, value: float) -> None:
        self.value = value  # one writer (the engine thread, or the event loop); a plain store is atomic

    def render(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} gauge", f"{self.name} {_number(self.value)}"]


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = PREFIX + name, help_text, buckets
        self._counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.buckets, value)] += 1
            self._sum += value

    @property
    def count(self) -> int:
        with self._lock:
            return sum(self._counts)

    def render(self) -> list[str]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, c in zip([*map(_number, self.buckets), "+Inf"], counts):
            cumulative += c
            lines.append(f'{self.name}_bucket{{le="{bound}"}} {cumulative}')
        lines += [f"{self.name}_sum {_number(total)}", f"{self.name}_count {cumulative}"]
        return lines


class Metrics:
    def __init__(self):
        self.http_requests = Counter("http_requests_total", "HTTP requests answered, by route and status code.",
                                     ("route", "status"))
        self.requests_finished = Counter(
            "requests_finished_total", "Generation requests that left the engine, by finish reason "
            "(stop, length, abort: cancelled or client gone, error).", ("finish_reason",))
        self.prompt_tokens = Counter("prompt_tokens_total", "Prompt tokens of admitted requests.")
        self.generation_tokens = Counter("generation_tokens_total", "Tokens generated.")
        self.engine_steps = Counter("engine_steps_total", "Engine steps run.")
        self.requests_running = Gauge("requests_running", "Requests holding a KV-cache slot (the batch).")
        self.requests_waiting = Gauge("requests_waiting", "Requests queued for a slot (the queue depth).")
        self.prompts_preparing = Gauge("prompts_preparing", "Prompts being rendered through the chat template "
                                       "or tokenized, on the prompt threads.")
        self.batch_size = Histogram("batch_size", "Sequences that got a token in one engine step.", _BATCH_BUCKETS)
        self.time_to_first_token = Histogram(
            "time_to_first_token_seconds", "From a request's arrival at the engine to its first token.",
            _LATENCY_BUCKETS)
        self.inter_token_latency = Histogram(
            "inter_token_latency_seconds", "Between two consecutive tokens of one request.", _LATENCY_BUCKETS)
        self.step_time = Histogram("step_seconds", "Wall time of one engine step.", _LATENCY_BUCKETS)
        self.prefix_cache_queries = Counter("prefix_cache_queries_total",
                                            "Prompt tokens looked up in the prefix cache (each request once).")
        self.prefix_cache_hits = Counter("prefix_cache_hits_total",
                                         "Prompt tokens found in the prefix cache: not computed again.")
        self.prefix_cache_hit_rate = Gauge("prefix_cache_hit_rate", "prefix_cache_hits_total over "
                                           "prefix_cache_queries_total since the server started.")
        self.kv_cache_usage = Gauge("kv_cache_usage", "Share of the KV cache's blocks held by running requests.")
        self.preemptions = Counter("preemptions_total", "Requests preempted for want of KV-cache blocks "
                                   "(computed again when readmitted).")

    def render(self) -> str:
        lines: list[str] = []
        for metric in (self.http_requests, self.requests_finished, self.prompt_tokens, self.generation_tokens,
                       self.engine_steps, self.requests_running, self.requests_waiting, self.prompts_preparing,
                       self.batch_size, self.time_to_first_token, self.inter_token_latency, self.step_time,
                       self.prefix_cache_queries, self.prefix_cache_hits, self.prefix_cache_hit_rate,
                       self.kv_cache_usage, self.preemptions):
            lines += metric.render()
        return "\n".join(lines) + "\n"
