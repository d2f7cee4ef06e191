"""Bounded soak run on loopback: a few hundred mixed requests against a server this script starts.

    python3 benchmarks/serve.py soak --model DIR --requests 400 --threads 8

First a clean phase (a quarter of the requests, well-formed only), then a hostile one: well-formed greedy chat,
completion and Ollama requests, streamed and not, each checked against the answer the same request got alone
before the soak, among malformed JSON, wrong types, sampling values no sampler honours, prompts too long for
the context or megabytes long, hundreds of stop strings, deeply nested JSON, lone surrogates, clients that
vanish mid-stream or before a non-streamed answer, and half-sent requests (benchmarks/lib/soak_requests.py).
At the end the server must still be up with nothing in flight and every request must have got its answer;
the report gives the counts per kind, the server's RSS before and after (VmRSS), and the p50 / p99 latency of
the well-formed requests in each phase (the hostile phase's p99 over the clean one's: target <= 1.5x).
Everything goes to 127.0.0.1; the run stops after --requests requests or --max-seconds.
"""

from __future__ import annotations

import json
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from .cli import write_json
from .soak_requests import PROMPTS, Client


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


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
    client = Client(port)
    try:
        wait_for_health(client, server)
        for prompt in PROMPTS:  # references: each well-formed request alone, before any load
            for api in ("chat", "completion"):
                client.reference[(api, prompt)] = client.answer(api, prompt, streaming=False)
        rss_before = rss_mib(server.pid)
        start = time.perf_counter()
        clean = args.requests // 4
        send(client, "clean", clean, args, start)
        send(client, "hostile", args.requests - clean, args, start)
        seconds = time.perf_counter() - start
        health = settled_health(client)
        rss_after = rss_mib(server.pid)
        c = client.conn()
        c.request("GET", "/metrics")
        metrics = c.getresponse().read().decode()
        after = {name: next(float(line.split()[1]) for line in metrics.splitlines()
                            if line.startswith(f"hybridmoe_{name} "))
                 for name in ("requests_running", "kv_cache_usage")}  # KV blocks held: none once all are done
    finally:
        alive = server.poll() is None
        server.terminate()
        server.wait(timeout=30)
    return report(args, client, seconds, alive, health, after, rss_before, rss_after)


def wait_for_health(client: Client, server: subprocess.Popen) -> None:
    for _ in range(600):
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode} before it answered /health")
        try:
            client.conn().request("GET", "/health")
            return
        except OSError:
            time.sleep(0.2)


def send(client: Client, phase: str, requests: int, args, start: float) -> None:
    """`requests` requests of `phase` from args.threads clients at once (each its own seeded mix)."""
    todo = iter(range(requests))
    lock = threading.Lock()

    def loop(i):
        rng = random.Random(f"{args.seed} {phase} {i}")
        while time.perf_counter() - start < args.max_seconds:
            with lock:
                if next(todo, None) is None:
                    return
            client.one(rng, phase)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def settled_health(client: Client) -> dict:
    """/health once nothing is in flight (aborted requests leave the engine within a step or two), or after 30 s."""
    deadline = time.monotonic() + 30
    while True:
        c = client.conn()
        c.request("GET", "/health")
        health = json.loads(c.getresponse().read())
        if health["requests_in_flight"] == 0 or time.monotonic() > deadline:
            return health
        time.sleep(0.1)


def report(args, client: Client, seconds, alive, health, after: dict, rss_before, rss_after) -> int:
    lat = {phase: {"n": len(v), "p50_s": percentile(v, 50), "p99_s": percentile(v, 99)}
           for phase, v in client.latency.items()}
    p99_ratio = lat["hostile"]["p99_s"] / lat["clean"]["p99_s"]
    result = {"requests": sum(client.counts.values()), "seconds": seconds,
              "counts": dict(sorted(client.counts.items())), "failures": client.failures[:20],
              "server_alive": alive, "in_flight_after": health["requests_in_flight"],
              "running_after": after["requests_running"], "kv_cache_usage_after": after["kv_cache_usage"],
              "rss_mib_before": rss_before, "rss_mib_after": rss_after, "latency": lat, "p99_ratio": p99_ratio}
    print(f"{result['requests']} requests in {seconds:.0f} s from {args.threads} clients; server alive: {alive}; "
          f"in flight after: {health['requests_in_flight']}, running: {after['requests_running']:.0f}, KV cache "
          f"blocks held: {after['kv_cache_usage']:.0%}")
    for name, n in result["counts"].items():
        print(f"  {n:5d}  {name}")
    print(f"RSS: {rss_before:.0f} MiB before, {rss_after:.0f} MiB after ({rss_after / rss_before - 1:+.1%})")
    for phase, v in lat.items():
        print(f"well-formed latency, {phase} phase: {v['n']} requests, p50 {1000 * v['p50_s']:.0f} ms, "
              f"p99 {1000 * v['p99_s']:.0f} ms")
    print(f"p99 hostile / clean: {p99_ratio:.2f}x (target <= 1.5x)")
    for f in result["failures"]:
        print("FAILED", f)
    write_json(args.json, result)
    ok = (alive and not client.failures and health["requests_in_flight"] == 0 and after["requests_running"] == 0
          and after["kv_cache_usage"] == 0)
    return 0 if ok else 1
