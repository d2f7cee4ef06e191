"""`hybridmoe doctor` and `hybridmoe profile-experts` end to end on a tiny checkpoint."""

import json

from hybridmoe.cli import main
from hybridmoe.experts.placement import ExpertStats
from hybridmoe.system.host import count_cpu_list, meminfo, numa_nodes


def test_doctor_prints_the_host_and_the_plan_for_a_model(tiny_checkpoints, capsys):
    path = tiny_checkpoints("qwen3_moe")
    assert main(["doctor", "--model", str(path), "--measure-bytes", "64MiB", "--gpu-memory-budget", "1GiB"]) == 0
    out = capsys.readouterr().out
    for key in ("isa:", "cores:", "NUMA nodes:", "ram:", "host read:", "choices:", "placement:", "floor:"):
        assert key in out
    assert "uniform: 16 of 16 routed experts on the GPU" in out  # 1 GiB holds this tiny model whole
    assert "0.0 CPU experts" in out


def test_doctor_refuses_a_budget_that_cannot_hold_the_model(tiny_checkpoints, capsys):
    path = tiny_checkpoints("qwen3_moe")
    assert main(["doctor", "--model", str(path), "--measure-bytes", "1MiB", "--gpu-memory-budget", "1MiB"]) == 2
    assert "too small" in capsys.readouterr().err


def test_profile_counts_every_routed_token_and_feeds_frequency_placement(tiny_checkpoints, tmp_path, capsys):
    path = tiny_checkpoints("qwen3_moe")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello there\n\nthe quick brown fox\n")
    out = tmp_path / "stats.json"
    assert main(["profile-experts", "--model", str(path), "--prompts", str(prompts), "--out", str(out),
                 "--max-tokens", "3", "--max-model-len", "64"]) == 0
    raw = json.loads(out.read_text())
    stats = ExpertStats.load(out, [0, 1], 8)
    assert raw["tokens"] == stats.tokens > 0
    top_k = 2
    assert all(sum(c) == stats.tokens * top_k for c in stats.counts.values())
    assert main(["doctor", "--model", str(path), "--measure-bytes", "1MiB", "--gpu-memory-budget", "300MiB",
                 "--expert-placement", "frequency", "--expert-stats", str(out)]) == 0
    assert "frequency:" in capsys.readouterr().out


def test_host_facts_are_read_from_kernel_files(tmp_path):
    assert count_cpu_list("0-3,8,10-11\n") == 7 and count_cpu_list("0") == 1
    (tmp_path / "online").write_text("0-1\n")
    assert numa_nodes(tmp_path) == 2
    assert numa_nodes(tmp_path / "missing") == 1
    (tmp_path / "meminfo").write_text("MemTotal:       1000 kB\nMemFree:  10 kB\nMemAvailable:     500 kB\n")
    assert meminfo(tmp_path / "meminfo") == (1024000, 512000)
