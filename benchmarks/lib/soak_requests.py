"""The soak's requests: well-formed ones checked against the answer each got alone, and hostile ones (malformed
or absurd bodies, parameters no sampler can honour, oversized prompts and stop lists, clients that vanish or
send half a request), each with the answer the server must give.

A kind is a function (client, rng, prompt) -> (ok, detail); KINDS weighs them in the hostile mix.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time
from collections import Counter

PROMPTS = ["Tell me about mixture of experts", "hello", "Why is the sky blue? " * 5, "One two three",
           "A longer prompt that goes on " * 12, "Write a haiku"]
MAX_TOKENS = 24


class Client:
    """HTTP to the server under soak, and the books: counts per kind, failures, well-formed latencies."""

    def __init__(self, port: int):
        self.port = port
        self.counts: Counter = Counter()
        self.failures: list[str] = []
        self.latency: dict[str, list[float]] = {"clean": [], "hostile": []}
        self.lock = threading.Lock()
        self.reference: dict[tuple, str] = {}

    def conn(self, timeout: float = 120) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def post(self, path: str, body: bytes | dict) -> tuple[int, bytes]:
        c = self.conn()
        c.request("POST", path, body if isinstance(body, bytes) else json.dumps(body),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
        c.close()
        return r.status, data

    def stream(self, path: str, body: dict) -> str:
        c = self.conn()
        c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            raise RuntimeError(f"{path}: {r.status} {r.read()[:200]!r}")
        text = []
        for line in iter(r.readline, b""):
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(f"{path}: error event {event}")
                for ch in event["choices"]:
                    text.append(ch.get("text") or ch.get("delta", {}).get("content") or "")
        c.close()
        return "".join(text)

    def answer(self, api: str, prompt: str, streaming: bool) -> str:
        if api == "chat":
            body = {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": MAX_TOKENS,
                    "stream": streaming}
            if streaming:
                return self.stream("/v1/chat/completions", body)
            status, data = self.post("/v1/chat/completions", body)
            return json.loads(data)["choices"][0]["message"]["content"] if status == 200 else f"HTTP {status}"
        body = {"prompt": prompt, "temperature": 0, "max_tokens": MAX_TOKENS, "stream": streaming}
        if streaming:
            return self.stream("/v1/completions", body)
        status, data = self.post("/v1/completions", body)
        return json.loads(data)["choices"][0]["text"] if status == 200 else f"HTTP {status}"

    def record(self, name: str, ok: bool, detail: str = "") -> None:
        with self.lock:
            self.counts[name + (" ok" if ok else " FAILED")] += 1
            if not ok:
                self.failures.append(f"{name}: {detail}"[:300])

    def one(self, rng: random.Random, phase: str) -> None:
        """One request of `phase`: "clean" sends well-formed ones only, "hostile" the whole mix."""
        names = ["valid"] if phase == "clean" else [n for n, (w, _) in KINDS.items() for _ in range(w)]
        kind = rng.choice(names)
        start = time.perf_counter()
        try:
            ok, detail = KINDS[kind][1](self, rng, rng.choice(PROMPTS))
        except Exception as e:  # noqa: BLE001 (any exception is a failed request, reported at the end)
            ok, detail = False, f"{type(e).__name__}: {e}"
        if kind == "valid" and ok:
            with self.lock:
                self.latency[phase].append(time.perf_counter() - start)
        self.record(kind, ok, detail)


def status_is(want: int, status: int) -> tuple[bool, str]:
    return status == want, f"got HTTP {status}, want {want}"


def valid(c: Client, rng: random.Random, prompt: str) -> tuple[bool, str]:
    api, streaming = rng.choice(["chat", "completion"]), rng.random() < 0.5
    got, want = c.answer(api, prompt, streaming), c.reference[(api, prompt)]
    return got == want, f"{api} {'stream' if streaming else 'plain'}: {got!r} != {want!r}"


def ollama(c: Client, rng: random.Random, prompt: str) -> tuple[bool, str]:
    status, data = c.post("/api/chat", {"model": "soak", "stream": False, "options": {
        "temperature": 0, "num_predict": MAX_TOKENS}, "messages": [{"role": "user", "content": prompt}]})
    got = json.loads(data)["message"]["content"] if status == 200 else f"HTTP {status}"
    return got == c.reference[("chat", prompt)], f"{got!r} != {c.reference[('chat', prompt)]!r}"


def malformed(c: Client, rng: random.Random, prompt: str) -> tuple[bool, str]:
    return status_is(400, c.post("/v1/chat/completions", rng.choice([b"{", b"[1,2]", b"\xff\xfe", b""]))[0])


def wrong_type(c: Client, rng: random.Random, prompt: str) -> tuple[bool, str]:
    field = rng.choice(["temperature", "max_tokens", "n", "top_p"])
    status, _ = c.post("/v1/completions", {"prompt": prompt, field: rng.choice(["x", -3, [1], 1e9])})
    return status in (400, 422), f"{field}: got HTTP {status}, want 400 or 422"


def absurd_sampling(c: Client, rng: random.Random, prompt: str) -> tuple[bool, str]:
    field, value = rng.choice([("temperature", 1e-40), ("temperature", 5e-324), ("repetition_penalty", 1e-300),
                               ("top_k", 10**30), ("max_tokens", 10**30)])
    status, data = c.post("/v1/completions", {"prompt": prompt, field: value})
    return status == 400 and field in data.decode(errors="replace"), f"{field}={value}: HTTP {status} {data[:120]!r}"


def too_long(c: Client, rng: random.Random, prompt: str) -> tuple[bool, str]:
    return status_is(400, c.post("/v1/completions", {"prompt": prompt, "max_tokens": 100000})[0])


def huge_prompt(c: Client, rng: random.Random, prompt: str) -> tuple[bool, str]:
    """A few MB of text: refused on its length, before it is tokenized."""
    return status_is(400, c.post("/v1/completions", {"prompt": "word " * rng.randint(200_000, 800_000)})[0])


def many_stops(c: Client, rng: random.Random, prompt: str) -> tuple[bool, str]:
    stops = [f"stop{i}" for i in range(rng.choice([65, 1000, 20000]))]
    return status_is(400, c.post("/v1/completions", {"prompt": prompt, "stop": stops})[0])


def nested_json(c: Client, rng: random.Random, prompt: str) -> tuple[bool, str]:
    depth = rng.choice([1000, 100_000])
    body = b'{"prompt": "x", "extra": ' + b"[" * depth + b"]" * depth + b"}"
    return status_is(400, c.post("/v1/completions", body)[0])


def lone_surrogate(c: Client, rng: random.Random, prompt: str) -> tuple[bool, str]:
    body = b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 4}'
    return status_is(400, c.post("/v1/chat/completions", body)[0])


def disconnect_stream(c: Client, rng: random.Random, prompt: str) -> tuple[bool, str]:
    conn = c.conn()
    conn.request("POST", "/v1/completions", json.dumps(
        {"prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True}), {"Content-Type": "application/json"})
    r = conn.getresponse()
    for _ in range(rng.randint(1, 5)):
        r.readline()
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    return True, ""


def disconnect_wait(c: Client, rng: random.Random, prompt: str) -> tuple[bool, str]:
    conn = c.conn()
    conn.request("POST", "/v1/chat/completions", json.dumps(
        {"messages": [{"role": "user", "content": prompt}], "max_tokens": 400, "ignore_eos": True}),
        {"Content-Type": "application/json"})
    time.sleep(rng.uniform(0.01, 0.2))
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    return True, ""


def half_request(c: Client, rng: random.Random, prompt: str) -> tuple[bool, str]:
    """Headers that promise a body, part of it, then silence for a moment, then gone."""
    with socket.create_connection(("127.0.0.1", c.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
        time.sleep(rng.uniform(0.05, 0.5))
    return True, ""


KINDS = {"valid": (8, valid), "ollama": (1, ollama), "malformed": (1, malformed), "wrong_type": (1, wrong_type),
         "absurd_sampling": (2, absurd_sampling), "too_long": (1, too_long), "huge_prompt": (1, huge_prompt),
         "many_stops": (1, many_stops), "nested_json": (1, nested_json), "lone_surrogate": (1, lone_surrogate),
         "disconnect_stream": (1, disconnect_stream), "disconnect_wait": (1, disconnect_wait),
         "half_request": (1, half_request)}
"""kind -> (weight in the hostile phase, the request)."""
