"""`benchmarks/decode.py estimate` end to end on a tiny checkpoint it writes with a changed expert count: one row
per repeat, each with doctor's estimate, bench's decode and the bytes doctor counted, and the best-of ratio. The
ratio's size is the benchmark's finding on an idle machine, not asserted here."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "decode.py"


def test_each_repeat_has_a_row_and_the_ratio_is_of_the_best(tmp_path):
    out = tmp_path / "estimate.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "estimate", "--preset", "qwen3_moe:tiny", "--layers", "1", "--set",
         "num_experts=4", "--repeats", "2", "--prompt-len", "8", "--gen-len", "4", "--measure-bytes", "1MiB",
         "--engine", "--expert-backend torch", "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert len(data["runs"]) == 2 and "best of 2: estimate" in proc.stdout
    for row in data["runs"]:
        assert row["estimate_tok_s"] > 0 and row["bench_tok_s"] > 0 and row["bound"] == "cpu"
        assert row["bytes_per_token"]["routed_experts_cpu"] == 2 * 3 * 64 * 32 * 2  # top_k 2, bf16 [32, 64] x 3
    assert data["estimate_tok_s"] == max(r["estimate_tok_s"] for r in data["runs"])
    assert data["ratio"] == data["estimate_tok_s"] / data["bench_tok_s"]


def test_a_set_that_is_not_key_equals_integer_is_a_one_line_error(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "estimate", "--preset", "qwen3_moe:tiny", "--set", "num_experts"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--set takes KEY=INT, got 'num_experts'" in proc.stderr
