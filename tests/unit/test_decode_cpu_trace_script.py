"""`benchmarks/decode.py cpu-trace` end to end on the CPU device: tiny Qwen3 (2 MoE layers, 4 experts, top-2)
decoded with every CPU layer traced, then the captured calls replayed standalone."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "decode.py"
CALLS = 3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("trace") / "trace.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "cpu-trace", "--synthetic", "qwen3_moe:tiny", "--layers", "2", "--device", "cpu",
         "--format", "int4", "--group-size", "32", "--calls", str(CALLS), "--threads", "2", "--prompt-len", "8",
         "--bandwidth-bytes", str(16 << 20), "--torch-threads", "0,1", "--max-model-len", "64", "--json", str(out)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, json.loads(out.read_text())


def test_the_output_says_the_cpu_device_has_no_graphs_nor_handoff_and_sets_both_sides_per_layer(run):
    text, _ = run
    assert "no CUDA graph, no handoff" in text
    for layer in (0, 1):
        assert f"layer {layer} pipeline" in text and f"layer {layer} standalone" in text
    assert text.count("pipeline / standalone: wall") == 2 * 3  # 2 layers and all layers, in each of 2 rounds
    assert "## torch CPU threads 1 (set)" in text


def test_every_traced_decode_call_is_replayed_with_its_own_routing(run):
    _, data = run
    assert not data["cuda"] and data["threads"] == 2
    assert [r["torch_threads"] for r in data["rounds"]][1] == 1
    rows = [row for r in data["rounds"] for row in r["layers"]]
    assert [row["layer"] for row in rows] == [0, 1, 0, 1]
    for r in data["rounds"]:
        assert r["overall"]["pipeline"]["calls"] == r["overall"]["standalone"]["calls"] == 2 * CALLS
    for row in rows:
        pipe, solo = row["pipeline"], row["standalone"]
        assert pipe["calls"] == solo["calls"] == CALLS
        # one token, top-2 of 4 experts, all on the CPU: 2 distinct experts, 1 row each, no padding
        for side in (pipe, solo):
            assert (side["T"], side["K"], side["A"], side["zero_slots"]) == (1, 2, 2, 0)
            assert side["rows_per_expert"] == 1.0
            assert len(side["gbps_by_worker"]) == len(side["slept_by_worker"]) == 2
            assert side["gbps_by_worker"][0] > 0  # the calling thread always computes
            assert 0 < side["gemm"] <= side["wall"] and side["bytes"] > 0 and side["floor"] > 0
        assert pipe["bytes"] == solo["bytes"]  # the same calls read the same weights


def test_with_deferral_each_call_shows_its_deferred_part_in_both_the_pipeline_and_the_replay(tmp_path):
    """--deferred-experts 1: each layer's one call computes its own expert and its deferred one (top-2 of 4, one
    token: distinct experts); the replay runs the same merged calls (forward_deferred), so both sides read the same
    bytes and report the deferred part: out ready inside the run, the deferred expert's items after it. --timeline
    prints the first pipeline call's items per worker."""
    out = tmp_path / "trace.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "cpu-trace", "--synthetic", "qwen3_moe:tiny", "--layers", "2", "--device", "cpu",
         "--format", "int4", "--group-size", "32", "--calls", "2", "--threads", "2", "--prompt-len", "8",
         "--bandwidth-bytes", str(16 << 20), "--max-model-len", "64", "--deferred-experts", "1", "--timeline", "1",
         "--json", str(out)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("deferred part (2 calls)") == 2 * 2  # 2 layers x (pipeline, standalone)
    # --timeline 1: each layer's first pipeline call, its workers' items (D: a deferred slot's expert)
    assert proc.stdout.count("timeline (us from the run's start") == 2 and "own output ready at" in proc.stdout
    assert " gD" in proc.stdout and " dD" in proc.stdout
    for row in json.loads(out.read_text())["rounds"][0]["layers"]:
        pipe, solo = row["pipeline"], row["standalone"]
        assert pipe["bytes"] == solo["bytes"] and pipe["A"] == solo["A"] == 2
        for side in (pipe, solo):
            d = side["deferral"]
            assert side["deferral_calls"] == 2 and d["d_items"] > 0
            assert 0 < d["ready"] <= side["gemm"] and d["after"] >= 0
            assert d["d_before"] >= 0 and d["d_after"] >= 0 and d["d_workers"] <= 2
