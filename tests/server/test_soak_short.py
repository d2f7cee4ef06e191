"""The soak benchmark's short form (benchmarks/serve.py soak), as CI runs it: a server of its own on loopback,
a clean phase of well-formed requests, then well-formed requests among hostile ones (malformed and absurd
bodies, sampling values no sampler honours, megabyte prompts, long stop lists, nested JSON, lone surrogates,
vanishing and half-sent clients). Every request gets its answer, well-formed ones their solo answer; the
server ends up, with nothing in flight and every KV block back in the pool."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_soak_short_form(tiny_qwen3_fp32, tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve.py"), "soak", "--model",
                           str(tiny_qwen3_fp32), "--requests", "72", "--threads", "4", "--max-seconds", "600",
                           "--json", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["server_alive"] and result["in_flight_after"] == 0 and not result["failures"]
    assert result["kv_cache_usage_after"] == 0  # every KV block back in the pool, disconnected clients' too
    assert result["requests"] == 72 and result["latency"]["clean"]["n"] == 18
