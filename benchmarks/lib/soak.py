"""Bounded soak run on loopback: a few hundred mixed requests against a server this script starts.

    python3 benchmarks/serve.py soak --model DIR --requests 400 --threads 8

The mix: greedy chat and completion requests, streamed and not, each checked against the answer
the same request got alone before the soak; Ollama chat; malformed JSON, wrong types, prompts too
long for the context; clients that vanish mid-stream or before a non-streamed answer. At the end
the server must still be up with nothing in flight, every valid request must have returned its
reference answer, and the server's RSS is reported before and after (the process's VmRSS).
Everything goes to 127.0.0.1; the run stops after --requests requests or --max-seconds.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from .cli import write_json

PROMPTS = ["Tell me about mixture of experts", "hello", "Why is the sky blue? " * 5, "One two three",
           "A longer prompt that goes on " * 12, "Write a haiku"]
MAX_TOKENS = 24


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Soak:
    def __init__(self, port: int):
        self.port = port
        self.counts: Counter = Counter()
        self.failures: list[str] = []
        self.lock = threading.Lock()
        self.reference: dict[tuple, str] = {}

    def conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)

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

    def answer(self, kind: str, prompt: str, streaming: bool) -> str:
        if kind == "chat":
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
                self.failures.append(f"{name}: {detail}")

    def one(self, rng: random.Random) -> None:
        kind = rng.choice(["valid", "valid", "valid", "valid", "ollama", "malformed", "wrong_type", "too_long",
                           "disconnect_stream", "disconnect_wait"])
        prompt = rng.choice(PROMPTS)
        try:
            if kind == "valid":
                api, streaming = rng.choice(["chat", "completion"]), rng.random() < 0.5
                got = self.answer(api, prompt, streaming)
                want = self.reference[(api, prompt)]
                self.record(f"{api} {'stream' if streaming else 'plain'}", got == want, f"{got!r} != {want!r}")
            elif kind == "ollama":
                status, data = self.post("/api/chat", {"model": "soak", "stream": False, "options": {
                    "temperature": 0, "num_predict": MAX_TOKENS}, "messages": [{"role": "user", "content": prompt}]})
                got = json.loads(data)["message"]["content"] if status == 200 else f"HTTP {status}"
                want = self.reference[("chat", prompt)]
                self.record("ollama chat", got == want, f"{got!r} != {want!r}")
            elif kind == "malformed":
                status, _ = self.post("/v1/chat/completions", rng.choice([b"{", b"[1,2]", b"\xff\xfe", b""]))
                self.record("malformed json -> 400", status == 400, f"got {status}")
            elif kind == "wrong_type":
                status, _ = self.post("/v1/completions", {"prompt": prompt, rng.choice(
                    ["temperature", "max_tokens", "n", "top_p"]): rng.choice(["x", -3, [1], 1e9])})
                self.record("wrong type -> 422", status == 422, f"got {status}")
            elif kind == "too_long":
                status, _ = self.post("/v1/completions", {"prompt": prompt, "max_tokens": 100000})
                self.record("too long -> 400", status == 400, f"got {status}")
            elif kind == "disconnect_stream":
                c = self.conn()
                c.request("POST", "/v1/completions", json.dumps(
                    {"prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True}),
                    {"Content-Type": "application/json"})
                r = c.getresponse()
                for _ in range(rng.randint(1, 5)):
                    r.readline()
                c.sock.shutdown(socket.SHUT_RDWR)
                c.close()
                self.record("disconnect mid-stream", True)
            else:
                c = self.conn()
                c.request("POST", "/v1/chat/completions", json.dumps(
                    {"messages": [{"role": "user", "content": prompt}], "max_tokens": 400, "ignore_eos": True}),
                    {"Content-Type": "application/json"})
                time.sleep(rng.uniform(0.01, 0.2))
                c.sock.shutdown(socket.SHUT_RDWR)
                c.close()
                self.record("disconnect while waiting", True)
        except Exception as e:  # any exception is a failed request, reported at the end
            self.record(kind, False, f"{type(e).__name__}: {e}")


def add_arguments(p):
    p.add_argument("--model", required=True, metavar="DIR", help="model directory to serve")
    p.add_argument("--requests", type=int, default=400, help="requests in the soak (default 400)")
    p.add_argument("--threads", type=int, default=8, help="concurrent clients (default 8)")
    p.add_argument("--max-seconds", type=float, default=900, help="stop sending after this long (default 900)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix (default 0)")


def run(args) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "hybridmoe.cli", "serve", "--model", args.model, "--port",
                               str(port), "--dtype", "float32", "--served-model-name", "soak", "--max-batch", "8",
                               "--max-queue", "64", "--log-level", "error"])
    soak = Soak(port)
    try:
        for _ in range(600):
            try:
                soak.conn().request("GET", "/health")
                break
            except OSError:
                time.sleep(0.2)
        # references: each valid request alone, before any load
        for prompt in PROMPTS:
            for api in ("chat", "completion"):
                soak.reference[(api, prompt)] = soak.answer(api, prompt, streaming=False)
        rss_before = rss_mib(server.pid)
        start = time.perf_counter()
        todo = iter(range(args.requests))
        lock = threading.Lock()

        def client(i):
            rng = random.Random(args.seed * 1000 + i)
            while time.perf_counter() - start < args.max_seconds:
                with lock:
                    if next(todo, None) is None:
                        return
                soak.one(rng)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - start
        deadline = time.monotonic() + 30
        while True:  # aborted requests leave the engine within a step or two
            c = soak.conn()
            c.request("GET", "/health")
            health = json.loads(c.getresponse().read())
            if health["requests_in_flight"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        rss_after = rss_mib(server.pid)
        c = soak.conn()
        c.request("GET", "/metrics")
        metrics = c.getresponse().read().decode()
        running = next(float(line.split()[1]) for line in metrics.splitlines()
                       if line.startswith("hybridmoe_requests_running "))
    finally:
        alive = server.poll() is None
        server.terminate()
        server.wait(timeout=30)

    result = {"requests": sum(soak.counts.values()), "seconds": seconds, "counts": dict(sorted(soak.counts.items())),
              "failures": soak.failures[:20], "server_alive": alive, "in_flight_after": health["requests_in_flight"],
              "running_after": running, "rss_mib_before": rss_before, "rss_mib_after": rss_after}
    print(f"{result['requests']} requests in {seconds:.0f} s from {args.threads} clients; server alive: {alive}; "
          f"in flight after: {health['requests_in_flight']}, running: {running:.0f}")
    for name, n in result["counts"].items():
        print(f"  {n:5d}  {name}")
    print(f"RSS: {rss_before:.0f} MiB before, {rss_after:.0f} MiB after ({rss_after - rss_before:+.0f} MiB)")
    for f in result["failures"]:
        print("FAILED", f)
    write_json(args.json, result)
    ok = alive and not soak.failures and health["requests_in_flight"] == 0 and running == 0
    return 0 if ok else 1
