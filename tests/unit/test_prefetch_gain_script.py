"""`benchmarks/kernel.py prefetch` end to end on a small layer: every variant measured, the prefetch timed only
where it runs, cold the reference of the ratios."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "kernel.py"


def test_every_variant_has_a_row_and_only_the_named_ones_prefetch(tmp_path):
    out = tmp_path / "prefetch.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "prefetch", "--experts", "4", "--slots", "2", "--layers", "2", "--cycles", "2",
         "--tokens", "1,2", "--named", "1,0.5", "--touch", "2", "--threads", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    for T in (1, 2):
        mine = {r["variant"]: r for r in rows if r["T"] == T}
        assert list(mine) == ["cold", "warm", "named 1 touch 2", "named 0.5 touch 2"]
        assert mine["cold"]["vs_cold"] == 1.0
        assert mine["cold"]["prefetch_us"] == mine["warm"]["prefetch_us"] == 0.0
        assert all(mine[v]["prefetch_us"] > 0 for v in ("named 1 touch 2", "named 0.5 touch 2"))
        assert all(r["call_us"] > 0 and 1 <= r["distinct_experts"] <= 2 * T for r in mine.values())
