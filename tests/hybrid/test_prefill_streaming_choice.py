"""The automatic prefill-streaming decision (system/auto.py), the costs the loader then measures and what
they decide (streamed_prefill.measured_costs, StepCosts, attach), and the device memory placement sets
aside for streaming (experts/placement.py through streamed_prefill.reserved_bytes)."""

from dataclasses import replace

import pytest
import torch

from hybridmoe.cli import main
from hybridmoe.config import EngineConfig
from hybridmoe.errors import HybridMoEError
from hybridmoe.experts import streamed_prefill
from hybridmoe.experts.placement import model_footprint, placement_for
from hybridmoe.experts.streamed_prefill import (
    GPU_SECONDS_PER_WEIGHT,
    break_even_tokens,
    layer_packed_bytes,
    reserved_bytes,
    streamed_layer_seconds,
)
from hybridmoe.models.registry import load_config
from hybridmoe.system import auto

cpu_experts = pytest.importorskip("hybridmoe.experts.cpu_experts")


def test_break_even_of_a_qwen3_30b_a3b_int4_layer():
    # 302 MB at 50 GB/s is 6.04 ms; 8 experts x 3 x 2048 x 768 x 2 FLOP a token at 3 TFLOP/s
    flops = 2 * 3 * 2048 * 768 * 8
    assert break_even_tokens(302_000_000 / 50e9, 3e12, flops) == 241
    # the longer of the copy and the device's share of 128 experts' 604M weights
    weights = 128 * 3 * 2048 * 768
    assert streamed_layer_seconds(302_000_000, weights, 1e15) == weights * GPU_SECONDS_PER_WEIGHT
    assert streamed_layer_seconds(302_000_000, weights, 5e9) == 302_000_000 / 5e9


def test_packed_bytes_count_the_engines_padding():
    # int4 g128: half a byte a weight + a float32 scale per group, no padding at these sizes
    assert layer_packed_bytes("int4", 128, 2048, 768, 128, False) == 128 * (3 * 2048 * 768 // 2 + 3 * 2048 * 768 // 32)
    # bf16 rows pad to 32 columns: 40 -> 64
    assert layer_packed_bytes("bf16", 1, 64, 40, 128, False) == 2 * (64 * 64 * 2) + 64 * 64 * 2


def _cuda_config(**options):
    return EngineConfig(device="cuda", expert_backend="native", expert_format="int4", expert_group_size=32,
                        **options)


@pytest.fixture
def measured(monkeypatch):
    """Fix the two measured rates: PCIe bytes/s and CPU FLOP/s."""
    def set_rates(pcie: float, cpu: float):
        monkeypatch.setattr(auto, "measured_pcie_bandwidth", lambda device: pcie)
        monkeypatch.setattr(auto, "estimated_cpu_flops", lambda threads: cpu)
    return set_rates


def _decide(path, ec):
    cls, config = load_config(path)
    return auto.prefill_streaming_decision(ec, config, torch.float32)


def test_auto_streams_when_pcie_beats_the_cpu_within_a_step(tiny_checkpoints, measured):
    path = tiny_checkpoints("qwen3_moe")
    measured(pcie=1e9, cpu=1e9)
    d = _decide(path, _cuda_config(gpu_memory_budget="1GiB"))
    layer = layer_packed_bytes("int4", 8, 64, 32, 32, False)
    streamed = streamed_layer_seconds(layer, 8 * 3 * 64 * 32, 1e9)
    assert d.on and d.min_tokens == break_even_tokens(streamed, 1e9, 2 * 3 * 64 * 32 * 2)
    assert d.min_tokens <= 2048 and d.fits and d.measure_at_load  # the estimate; the loader measures


def test_auto_stays_off_when_the_cpu_wins_or_the_buffers_do_not_fit(tiny_checkpoints, measured):
    path = tiny_checkpoints("qwen3_moe")
    measured(pcie=1e6, cpu=1e12)
    slow = _decide(path, _cuda_config(gpu_memory_budget="1GiB"))
    assert slow.on is False and slow.fits
    measured(pcie=1e9, cpu=1e9)
    cls, config = load_config(path)
    fixed = model_footprint(cls, config, torch.float32, _cuda_config()).fixed_bytes
    tight = _decide(path, _cuda_config(gpu_memory_budget=fixed + 1000))
    assert tight.on is False and not tight.fits
    asked = _decide(path, _cuda_config(gpu_memory_budget="1GiB", prefill_streaming="on", prefill_streaming_tokens=7))
    assert asked.on and asked.min_tokens == 7 and not asked.measure_at_load


def test_the_cpu_device_streams_only_when_asked_and_torch_experts_cannot(tiny_checkpoints):
    path = tiny_checkpoints("qwen3_moe")
    cpu = dict(device="cpu", expert_backend="native", expert_format="int8", gpu_experts_per_layer=2)
    assert _decide(path, EngineConfig(**cpu)).on is False
    assert _decide(path, EngineConfig(prefill_streaming="on", **cpu)).on
    assert _decide(path, EngineConfig(device="cpu", expert_backend="native")).on is None  # no split
    with pytest.raises(HybridMoEError, match="expert_backend 'native'"):
        _decide(path, EngineConfig(device="cpu", expert_backend="torch", gpu_experts_per_layer=2,
                                   prefill_streaming="on"))
    with pytest.raises(HybridMoEError, match="prefill_streaming must be one of"):
        EngineConfig(prefill_streaming="yes")


def test_placement_sets_the_streaming_buffers_aside(tiny_checkpoints):
    path = tiny_checkpoints("qwen3_moe")
    cls, config = load_config(path)
    off = EngineConfig(device="cpu", expert_backend="native", expert_format="int4", expert_group_size=32,
                       prefill_streaming="off")
    on = EngineConfig(**{**vars(off), "prefill_streaming": "on"})
    fp_off, fp_on = (model_footprint(cls, config, torch.float32, ec) for ec in (off, on))
    assert fp_on.workspace_bytes - fp_off.workspace_bytes == reserved_bytes(on, 8, 64, 32, 2) > 0
    budget = fp_on.fixed_bytes + 5 * fp_on.expert_bytes
    plans = [placement_for(cls, config, torch.float32, EngineConfig(**{**vars(ec), "gpu_memory_budget": budget}))[0]
             for ec in (off, on)]
    assert plans[1].gpu_bytes <= budget and plans[1].num_gpu_experts < plans[0].num_gpu_experts


def test_doctor_prints_the_streaming_decision(tiny_checkpoints, capsys):
    path = str(tiny_checkpoints("qwen3_moe"))
    common = ["doctor", "--model", path, "--measure-bytes", "1MiB", "--device", "cpu", "--expert-backend", "native",
              "--expert-format", "int8", "--gpu-experts-per-layer", "2"]
    assert main([*common, "--prefill-streaming", "on", "--prefill-streaming-tokens", "64"]) == 0
    out = capsys.readouterr().out
    # asked for, but a CPU device has no GPU to stream to: the choice as given, and why it does not apply
    assert "prefill_streaming on (64+ tokens)" in out
    assert "no GPU:     --gpu-experts-per-layer, --prefill-streaming, --prefill-streaming-tokens" in out
    assert "streaming:  long prefill steps off (every routed expert runs where the model runs" in out
    assert main(common) == 0
    assert "streaming:  long prefill steps off" in capsys.readouterr().out


@pytest.fixture
def step_times(monkeypatch):
    """Fix what measured_costs times: the CPU engine's part of a step (a + b x tokens), the copy, and the
    device's work (c + d x tokens)."""
    def set_times(cpu: tuple[float, float], copy: float, gpu: tuple[float, float]):
        monkeypatch.setattr(streamed_prefill, "cpu_path_seconds",
                            lambda engine, device, tokens, share, top_k, repeats=2: cpu[0] + cpu[1] * tokens)
        monkeypatch.setattr(streamed_prefill, "device_step_seconds",
                            lambda streamer, layer, tokens, top_k: (copy, gpu[0] + gpu[1] * tokens))
    return set_times


def test_streaming_starts_where_the_cpu_path_is_no_faster():
    costs = streamed_prefill.StepCosts(cpu_fixed=0.002, cpu_per_token=1e-5, copy=0.004, gpu_fixed=0.001,
                                       gpu_per_token=1e-6)
    assert costs.cpu(600) == pytest.approx(0.008) and costs.stream(600) == 0.004  # the copy outlasts the work
    assert costs.stream(10_000) == pytest.approx(0.011)  # the work outlasts the copy
    assert costs.threshold() == 200  # the CPU path, 2 ms + T x 10 us, reaches the 4 ms copy
    assert streamed_prefill.StepCosts(0.0, 1e-5, 0.004, 0.0, 0.0).threshold() == 400
    assert streamed_prefill.StepCosts(0.0, 1e-5, 0.004, 0.0, 0.0).threshold(limit=150) == 151  # none up to 150
    assert streamed_prefill.StepCosts(0.01, 1e-5, 0.004, 0.0, 0.0).threshold() == 128  # the fit starts at 128


def test_measured_costs_fit_both_sides(step_times):
    E, H, I = 4, 64, 32
    engine = cpu_experts.CpuExperts(torch.randn(E, I, H), torch.randn(E, I, H), torch.randn(E, H, I),
                                    format="int8", threads=1)
    step_times(cpu=(0.004, 1e-5), copy=0.01, gpu=(0.002, 2e-6))
    streamer = streamed_prefill.PrefillStreamer({0: engine}, "cpu", min_tokens=1)
    costs, why = streamed_prefill.measured_costs(streamer, top_k=2, num_experts=8)
    assert costs.cpu_fixed == pytest.approx(0.004) and costs.cpu_per_token == pytest.approx(1e-5)
    assert "the CPU path 5.3 ms at 128 tokens, 9.1 ms at 512" in why
    assert costs.gpu_fixed == pytest.approx(0.002) and costs.gpu_per_token == pytest.approx(2e-6)
    assert costs.copy == 0.01 and "measured at load" in why


def test_a_real_step_is_timed_on_both_sides():
    engine = cpu_experts.CpuExperts(torch.randn(4, 32, 64), torch.randn(4, 32, 64), torch.randn(4, 64, 32),
                                    format="bf16", threads=1)
    assert 0 < streamed_prefill.cpu_path_seconds(engine, torch.device("cpu"), 16, share=0.5, top_k=2, repeats=1) < 1
    streamer = streamed_prefill.PrefillStreamer({3: engine}, "cpu", min_tokens=1)
    copy, work = streamed_prefill.device_step_seconds(streamer, 3, 16, top_k=2)
    assert 0 < copy < 1 and 0 < work < 1 and streamer.slot_layer.count(3) == 1


def test_a_layer_in_parts_is_timed_from_its_first_part(monkeypatch):
    engine = cpu_experts.CpuExperts(torch.randn(4, 32, 64), torch.randn(4, 32, 64), torch.randn(4, 64, 32),
                                    format="bf16", threads=1)
    monkeypatch.setattr(streamed_prefill, "SLOT_BYTES", 1)  # a part per expert
    streamer = streamed_prefill.PrefillStreamer({3: engine}, "cpu", min_tokens=1)
    times = iter([0.0, 0.5, 1.0, 1.25])  # the marks at the copy's and the work's start and end
    monkeypatch.setattr(streamed_prefill, "_mark", lambda stream: next(times))
    assert streamed_prefill.device_step_seconds(streamer, 3, 16, top_k=2) == (4 * 0.5, 4 * 0.25)
    assert streamer.slot_layer.count((3, 0)) == 1


def test_attach_streams_from_the_measured_count_or_not_at_all(tiny_checkpoints, step_times):
    from hybridmoe.engine.model_loader import load_model

    path = tiny_checkpoints("qwen3_moe")
    ec = EngineConfig(device="cpu", expert_backend="native", expert_format="int8", gpu_experts_per_layer=2,
                      prefill_streaming="off", max_num_batched_tokens=1024)
    backend = load_model(path, ec).experts
    auto_on = replace(ec, prefill_streaming="on", prefill_streaming_tokens=None)
    step_times(cpu=(0.0, 1e-5), copy=0.004, gpu=(0.001, 0.0))  # streamed: 4 ms a layer, from 400 tokens
    attached = streamed_prefill.attach(backend, auto_on)
    assert attached.prefill_streaming == "on" and attached.prefill_streaming_tokens == 400
    streamers = {backend._layers[layer].streamer for layer in backend.layers()}
    streamer = next(iter(streamers))
    assert len(streamers) == 1 and streamer.min_tokens == 400 and streamer.measured.copy == 0.004
    backend.stream_long_steps(None)
    step_times(cpu=(0.0, 1e-5), copy=0.1, gpu=(0.001, 0.0))  # 100 ms a layer: 10000 tokens > 1024
    assert streamed_prefill.attach(backend, auto_on).prefill_streaming == "off"
    assert all(backend._layers[layer].streamer is None for layer in backend.layers())
    asked = streamed_prefill.attach(backend, replace(auto_on, prefill_streaming_tokens=64))
    assert asked.prefill_streaming_tokens == 64 and backend._layers[0].streamer.measured is None  # the CPU device
