"""Serving benchmark: streamed /v1/completions at several concurrency levels against a running server.

    hybridmoe serve --model DIR --max-batch 16 &
    python3 benchmarks/serve.py throughput --url http://127.0.0.1:8000 --concurrency 1,4,8,16 --requests 32

Each level runs --requests requests from `concurrency` client threads (each sends its next request
when the previous one ends), every one generating exactly --max-tokens tokens (ignore_eos). It
reports, as a table and as JSON (--json):
  out tok/s     all output tokens over the level's wall time (prefills included);
  decode tok/s  aggregate decode throughput: concurrency x one stream's decode rate (its tokens
                after the first over the time from its first token to its last), i.e. the
                tokens/s of `concurrency` streams decoding side by side;
  x c1          decode tok/s relative to concurrency 1, the baseline, measured in the same run;
  TTFT, ITL     time to first token and inter-token latency (between text events), p50 and p99.
"""

from __future__ import annotations

import http.client
import json
import statistics
import sys
import threading
import time
from urllib.parse import urlparse

from hybridmoe.errors import HybridMoEError

from .cli import int_list, write_json


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


class Client:
    def __init__(self, url: str, api_key: str | None):
        u = urlparse(url)
        self.host, self.port = u.hostname, u.port or 80
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def get_json(self, path: str) -> dict:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
        conn.request("GET", path, headers=self.headers)
        r = conn.getresponse()
        body = r.read()
        conn.close()
        if r.status != 200:
            raise HybridMoEError(f"GET {path}: {r.status} {body[:200]!r}")
        return json.loads(body)

    def stream_completion(self, body: dict) -> dict:
        """One streamed request: its start, the arrival time of each text event, and its usage."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
        start = time.perf_counter()
        conn.request("POST", "/v1/completions", json.dumps(body), self.headers)
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"POST /v1/completions: {r.status} {r.read()[:200]!r}")
        times, usage = [], None
        while True:
            line = r.readline()
            if not line:
                break
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            now = time.perf_counter()
            if event.get("usage"):
                usage = event["usage"]
            if event.get("choices") and event["choices"][0]["text"]:
                times.append(now)
        conn.close()
        return {"start": start, "times": times, "end": time.perf_counter(),
                "output_tokens": usage["completion_tokens"] if usage else len(times)}


def run_level(client: Client, model: str, prompt: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    results, errors = [], []
    next_index = iter(range(requests))
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                if next(next_index, None) is None:
                    return
            try:
                res = client.stream_completion(body)
            except Exception as e:  # a failed request is counted, not fatal to the level
                with lock:
                    errors.append(str(e))
                continue
            with lock:
                results.append(res)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ttft = [r["times"][0] - r["start"] for r in results if r["times"]]
    itl = [b - a for r in results for a, b in zip(r["times"], r["times"][1:])]
    tokens = sum(r["output_tokens"] for r in results)
    decode_tokens = sum(max(r["output_tokens"] - 1, 0) for r in results)
    decode_seconds = sum(r["times"][-1] - r["times"][0] for r in results if r["times"])
    return {
        "concurrency": concurrency, "requests": len(results), "errors": len(errors), "wall_s": wall,
        "output_tokens": tokens, "output_tok_s": tokens / wall,
        "decode_tok_s": concurrency * decode_tokens / decode_seconds if decode_seconds else float("nan"),
        "ttft_p50_ms": 1000 * percentile(ttft, 50), "ttft_p99_ms": 1000 * percentile(ttft, 99),
        "itl_p50_ms": 1000 * percentile(itl, 50), "itl_p99_ms": 1000 * percentile(itl, 99),
        "itl_mean_ms": 1000 * statistics.fmean(itl) if itl else float("nan"),
    }


def add_arguments(p):
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    p.add_argument("--concurrency", default="1,4,8,16", help="comma-separated levels (default 1,4,8,16)")
    p.add_argument("--requests", type=int, default=32, help="requests per level (default 32)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (default 64)")
    p.add_argument("--prompt-words", type=int, default=32, help="words in the prompt (default 32)")
    p.add_argument("--api-key", default=None, help="bearer token, if the server wants one")
    p.add_argument("--warmup", type=int, default=2, help="requests sent first and not measured (default 2)")


def run(args) -> int:
    levels = int_list(args.concurrency)
    client = Client(args.url, args.api_key)
    model = client.get_json("/v1/models")["data"][0]["id"]
    prompt = " ".join(f"word{i}" for i in range(args.prompt_words))
    if args.warmup:
        run_level(client, model, prompt, 1, args.warmup, args.max_tokens)
    rows = []
    for c in levels:
        rows.append(run_level(client, model, prompt, c, max(args.requests, c), args.max_tokens))
        print(f"concurrency {c}: done", file=sys.stderr, flush=True)
    base = next((r["decode_tok_s"] for r in rows if r["concurrency"] == 1), None)
    for r in rows:
        r["decode_speedup_vs_c1"] = r["decode_tok_s"] / base if base else None

    header = (f"{'conc':>4} {'reqs':>4} {'err':>3} {'out tok/s':>10} {'decode tok/s':>12} {'x c1':>5} "
              f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}")
    print(f"model {model} at {args.url}: {args.max_tokens} tokens per request, prompt of {args.prompt_words} words")
    print(header)
    for r in rows:
        speedup = f"{r['decode_speedup_vs_c1']:.2f}" if r["decode_speedup_vs_c1"] else "-"
        print(f"{r['concurrency']:>4} {r['requests']:>4} {r['errors']:>3} {r['output_tok_s']:>10.1f} "
              f"{r['decode_tok_s']:>12.1f} {speedup:>5} {r['ttft_p50_ms']:>7.0f}ms {r['ttft_p99_ms']:>7.0f}ms "
              f"{r['itl_p50_ms']:>6.1f}ms {r['itl_p99_ms']:>6.1f}ms")
    write_json(args.json, {"url": args.url, "model": model, "max_tokens": args.max_tokens,
                           "prompt_words": args.prompt_words, "levels": rows})
    return 0
