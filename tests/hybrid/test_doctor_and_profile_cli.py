"""`hybridmoe doctor` and `hybridmoe profile-experts` end to end on a tiny checkpoint: on this machine's CPU,
and on a stand-in GPU (host facts and bandwidths given, the plan and the estimate computed as on a GPU host)."""

import dataclasses
import json

import pytest
import torch

from hybridmoe.cli import main
from hybridmoe.experts.placement import ExpertStats
from hybridmoe.system import bandwidth, host
from hybridmoe.system.auto import measured_pcie_bandwidth
from hybridmoe.system.host import count_cpu_list, meminfo, numa_nodes

EXPERT_F32 = 3 * 64 * 32 * 4
"""One routed expert of the tiny Qwen3-MoE in float32: gate, up and down of [32, 64]."""
ROUTED = 2 * 2
"""Routed experts one token reads: top_k 2 in each of its 2 MoE layers."""


@pytest.fixture
def stand_in_gpu(monkeypatch):
    """A host with one GPU whose memory reads at 1000 GB/s and whose PCIe copies at 50 GB/s."""
    gpu = host.GpuInfo("stand-in", 16 << 30, 16 << 30)
    real = host.host_info
    monkeypatch.setattr(host, "host_info", lambda: dataclasses.replace(real(), gpus=[gpu]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bandwidth, "pinned_h2d_bandwidth", lambda device, nbytes, repeats=5: 50e9)
    monkeypatch.setattr(bandwidth, "device_copy_bandwidth", lambda device, nbytes, repeats=5: 1000e9)
    measured_pcie_bandwidth.cache_clear()
    yield
    measured_pcie_bandwidth.cache_clear()


def _doctor(path, tmp_path, *flags) -> dict:
    """doctor --json's findings (its lines stay in capsys)."""
    out_json = tmp_path / "doctor.json"
    assert main(["doctor", "--model", str(path), "--measure-bytes", "16MiB", "--json", str(out_json), *flags]) == 0
    return json.loads(out_json.read_text())


def test_doctor_prints_the_host_and_the_plan_for_a_model(tiny_checkpoints, capsys):
    path = tiny_checkpoints("qwen3_moe")
    assert main(["doctor", "--model", str(path), "--measure-bytes", "64MiB"]) == 0
    out = capsys.readouterr().out
    for key in ("isa:", "cores:", "NUMA nodes:", "ram:", "host read:", "choices:", "placement:", "torch read:",
                "reads:", "estimate:"):
        assert key in out
    assert "every routed expert where the model runs, device cpu (8 x 2 MoE layers), run by torch" in out
    assert "bound by the CPU" in out and "no GPU:" not in out


def test_without_a_gpu_nothing_is_placed_on_one_and_the_gpu_flags_are_named(tiny_checkpoints, tmp_path, capsys):
    path = tiny_checkpoints("qwen3_moe")
    found = _doctor(path, tmp_path, "--gpu-memory-budget", "1GiB", "--gpu-experts-per-layer", "2",
                       "--deferred-experts", "1", "--no-cuda-graph", "--prefill-streaming", "off", "--max-num-seqs", "2")
    out = capsys.readouterr().out
    assert "on the GPU" not in out and "gpu read:" not in out
    assert ("no GPU:     --gpu-memory-budget, --gpu-experts-per-layer, --deferred-experts, --cuda-graph, "
            "--prefill-streaming: device cpu has no GPU") in out
    assert found["not_applied"] == ["gpu_memory_budget", "gpu_experts_per_layer", "deferred_experts", "cuda_graph",
                                 "prefill_streaming"]
    estimate = found["estimate"]
    assert estimate["bound"] == "cpu" and estimate["decode_tok_s"] > 0
    assert "kv cache:   8192 tokens in blocks of 64" in out and "each GiB" not in out  # 2 sequences x 4096
    assert estimate["bytes_per_token"]["routed_experts_gpu"] == 0
    assert estimate["bytes_per_token"]["routed_experts_cpu"] == ROUTED * EXPERT_F32
    assert estimate["decode_tok_s"] == pytest.approx(1 / estimate["seconds_per_token"])


def test_on_a_gpu_the_plan_splits_the_experts_and_the_estimate_overlaps_them(tiny_checkpoints, tmp_path, capsys,
                                                                            stand_in_gpu):
    path = tiny_checkpoints("qwen3_moe")
    found = _doctor(path, tmp_path, "--device", "cuda", "--gpu-memory-budget", "1GiB",
                       "--gpu-experts-per-layer", "4")
    out = capsys.readouterr().out
    assert "gpu read:   1000.0 GB/s" in out and "8 of 16 routed experts on the GPU" in out
    kv = found["placement"]["kv_cache"]  # the budget's trade between context and experts, in its line
    assert f"each GiB of GPU budget holds {kv['tokens_per_gib']} tokens of context or {(1 << 30) // EXPERT_F32} " \
           "routed experts" in out
    assert kv["max_model_len"] == 512 and kv["tokens"] >= 512 and kv["bytes"] > 0
    assert "no GPU:" not in out and "at once" in out
    estimate = found["estimate"]
    routed = estimate["bytes_per_token"]
    assert routed["routed_experts_gpu"] + routed["routed_experts_cpu"] == ROUTED * EXPERT_F32
    assert routed["routed_experts_gpu"] == ROUTED * EXPERT_F32 / 2  # without a profile, half the routing
    model_s = sum(v for k, v in routed.items() if not k.startswith("routed")) / 1000e9
    gpu_s, cpu_s = estimate["device_seconds"]["gpu"], estimate["device_seconds"]["cpu"]
    assert gpu_s == pytest.approx(model_s + routed["routed_experts_gpu"] / 1000e9)
    assert estimate["seconds_per_token"] == pytest.approx(model_s + max(cpu_s, gpu_s - model_s))
    assert estimate["bound"] == ("cpu" if cpu_s > gpu_s else "gpu")


def test_doctor_refuses_a_budget_that_cannot_hold_the_model(tiny_checkpoints, capsys):
    path = tiny_checkpoints("qwen3_moe")
    assert main(["doctor", "--model", str(path), "--measure-bytes", "1MiB", "--gpu-memory-budget", "1MiB"]) == 2
    assert "too small" in capsys.readouterr().err


def test_profile_counts_every_routed_token_and_feeds_frequency_placement(tiny_checkpoints, tmp_path, capsys,
                                                                        request):
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
    request.getfixturevalue("stand_in_gpu")  # the profile ran on the CPU; the plan is for a GPU
    assert main(["doctor", "--model", str(path), "--measure-bytes", "1MiB", "--gpu-memory-budget", "300MiB",
                 "--expert-placement", "frequency", "--expert-stats", str(out), "--device", "cuda"]) == 0
    assert "frequency:" in capsys.readouterr().out


def test_host_facts_are_read_from_kernel_files(tmp_path):
    assert count_cpu_list("0-3,8,10-11\n") == 7 and count_cpu_list("0") == 1
    (tmp_path / "online").write_text("0-1\n")
    assert numa_nodes(tmp_path) == 2
    assert numa_nodes(tmp_path / "missing") == 1
    (tmp_path / "meminfo").write_text("MemTotal:       1000 kB\nMemFree:  10 kB\nMemAvailable:     500 kB\n")
    assert meminfo(tmp_path / "meminfo") == (1024000, 512000)
