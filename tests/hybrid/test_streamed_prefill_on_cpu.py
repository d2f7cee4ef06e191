"""Long steps streamed to the device (experts/streamed_prefill.py), run on the CPU device in CI: the same
code as on a GPU, with plain copies instead of PCIe. The streamed experts equal a float32 reference on
the engine's own dequantized weights; a whole model gives the CPU path's logits within the format's
tolerance; short steps and "off" stay on the CPU engine, bit for bit."""

import pytest
import torch
import torch.nn.functional as F
from hybrid_helpers import PROMPT, load, prompt_logits

from hybridmoe.experts import streamed_prefill
from hybridmoe.experts.hybrid import weighted_experts
from hybridmoe.experts.packed_torch import PackedLayout
from hybridmoe.experts.streamed_prefill import PrefillStreamer, routed_experts

cpu_experts = pytest.importorskip("hybridmoe.experts.cpu_experts")

FORMATS = [("bf16", {}), ("int8", {}), ("int4", dict(expert_group_size=32)),
           ("int4", dict(expert_group_size=32, expert_zero_points=True)), ("mxfp4", {})]


def _layer(fmt: str, E=6, H=64, I=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g), torch.randn(E, H, I, generator=g))
    return cpu_experts.CpuExperts(*w, format=fmt, group_size=32, threads=1)


def _routing(T: int, K: int, E: int, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return ids, torch.rand(T, K, generator=g), torch.rand(T, K, generator=g) < 0.7


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4", "mxfp4"])
def test_routed_experts_from_packed_bytes_equal_the_float32_reference(fmt):
    engine = _layer(fmt)
    streamer = PrefillStreamer({3: engine}, "cpu", min_tokens=1)
    x = torch.randn(40, 64)
    ids, w, mask = _routing(40, 3, 6)
    got = streamer.run(3, x, ids, w, mask, F.silu)
    deq = [torch.stack(m) for m in zip(*(engine.dequantized(e) for e in range(6)))]
    torch.testing.assert_close(got, weighted_experts(x, *deq, ids, w, mask, F.silu), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_experts_dequantized_a_few_at_a_time_give_the_same_sum(fmt, monkeypatch):
    engine = _layer(fmt)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(0))
    ids, w, mask = _routing(40, 3, 6)
    whole = PrefillStreamer({0: engine}, "cpu", min_tokens=1).run(0, x, ids, w, mask, F.silu)
    per_expert = 64 * 96 * (3 * 2 + streamed_prefill.DEQUANT_BYTES_PER_WEIGHT)  # torch's dequantization
    monkeypatch.setattr(streamed_prefill, "DEQUANT_WORKSPACE_BYTES", 4 * per_expert)  # chunks of 4, then 2
    assert streamed_prefill.dequant_chunk_experts(64, 96, fused=False) == 4
    chunked = PrefillStreamer({0: engine}, "cpu", min_tokens=1).run(0, x, ids, w, mask, F.silu)
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=1e-4)  # float32 sums in another order


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_a_layer_above_the_slot_size_streams_in_parts_with_the_same_sum(fmt, monkeypatch):
    engines = {layer: _layer(fmt, seed=layer) for layer in (1, 2)}
    x = torch.randn(40, 64)
    ids, w, mask = _routing(40, 3, 6)
    G = 2  # resident experts: the slots outside mask, ids 0..G-1 (they join the last part)
    resident = tuple(torch.randn(G, *shape) * 0.05 for shape in ((96, 64), (96, 64), (64, 96)))
    rids = torch.where(mask, ids, ids % G)
    whole = PrefillStreamer(engines, "cpu", min_tokens=1)
    want = {layer: whole.run(layer, x, rids, w, mask, F.silu, resident) for layer in (1, 2)}
    nbytes = whole.layers[1].nbytes
    monkeypatch.setattr(streamed_prefill, "SLOT_BYTES", nbytes // 3)  # 3 parts of 2 experts
    parts = PrefillStreamer(engines, "cpu", min_tokens=1)
    assert parts.keys[1] == [(1, 0), (1, 1), (1, 2)] and parts.order[3] == (2, 0)
    assert parts.slot_bytes <= streamed_prefill.slot_bytes(nbytes, 6) < whole.slot_bytes  # what placement sets aside
    for layer in (1, 2, 1):
        torch.testing.assert_close(parts.run(layer, x, rids, w, mask, F.silu, resident), want[layer],
                                   atol=1e-4, rtol=1e-4)  # float32 sums in another order
    assert parts.slot_layer.count((1, 2)) == 1 and (2, 0) in parts.slot_layer  # the last part, then the next unit


@pytest.mark.parametrize("slot_parts", [1, 3])
def test_deferred_columns_come_apart_from_one_stream_of_the_layer(monkeypatch, slot_parts):
    """run(deferred=d): the sums over each token's first K - d columns and its last d, as two runs over each
    column set give them, every unit of the layer copied once (a layer whole, and in 3 parts)."""
    engine = _layer("int4")
    x = torch.randn(40, 64)
    ids, w, mask = _routing(40, 3, 6)
    G = 2
    resident = tuple(torch.randn(G, *shape) * 0.05 for shape in ((96, 64), (96, 64), (64, 96)))
    rids = torch.where(mask, ids, ids % G)
    plain = PrefillStreamer({0: engine}, "cpu", min_tokens=1)
    later = torch.tensor([False, False, True])
    # each side alone: the other columns as resident slots of weight 0 (expert 0)
    want = [plain.run(0, x, torch.where(cols, rids, 0), w * cols, mask & cols, F.silu, resident)
            for cols in (~later, later)]
    if slot_parts > 1:
        monkeypatch.setattr(streamed_prefill, "SLOT_BYTES", plain.layers[0].nbytes // slot_parts)
    streamer = PrefillStreamer({0: engine}, "cpu", min_tokens=1)
    copied = []  # the units whose copy a _stage call started (not already in a slot)

    def stage(key, stage=streamer._stage):
        copied.extend([key] if key not in streamer.slot_layer else [])
        return stage(key)
    monkeypatch.setattr(streamer, "_stage", stage)
    got = streamer.run(0, x, rids, w, mask, F.silu, resident, deferred=1)
    # each unit once for both sides, and the first again as the next step's (a one-unit layer is still in its slot)
    keys = streamer.keys[0]
    assert copied == keys + keys[:1] if len(keys) > 1 else copied == keys
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_, atol=1e-4, rtol=1e-4)


def test_a_bf16_step_computes_in_bf16_against_the_native_engine():
    engine = _layer("bf16")
    x = torch.randn(33, 64).to(torch.bfloat16)
    ids, w, _ = _routing(33, 2, 6)
    state = engine.packed_state()
    layout_buffers = {n: torch.from_numpy(a).view(torch.uint8) for n, a in state["buffers"].items()}
    got = routed_experts(PackedLayout(state), layout_buffers, x, ids, w, torch.ones_like(ids, dtype=torch.bool),
                         F.silu)
    want = engine.forward(x, ids, w).float()
    assert ((got - want).norm() / want.norm()).item() < 2e-2


def test_layers_alternate_between_two_slots_and_a_repeat_reuses_its_slot():
    engines = {layer: _layer("int8", seed=layer) for layer in (1, 2, 4)}
    streamer = PrefillStreamer(engines, "cpu", min_tokens=1)
    x = torch.randn(8, 64)
    ids, w, mask = _routing(8, 2, 6)
    outs = {}
    for layer in (1, 2, 4, 4):
        outs.setdefault(layer, []).append(streamer.run(layer, x, ids, w, mask, F.silu))
        assert layer in streamer.slot_layer
    assert sorted(streamer.slot_layer) == [1, 4]  # after the last layer, the first is staged for the next step
    assert torch.equal(outs[4][0], outs[4][1])
    fresh = PrefillStreamer({2: engines[2]}, "cpu", min_tokens=1).run(2, x, ids, w, mask, F.silu)
    assert torch.equal(outs[2][0], fresh)


@pytest.fixture
def streamed_layers(monkeypatch):
    """The layers PrefillStreamer.run is called for, in order."""
    calls, run = [], PrefillStreamer.run

    def counted(self, layer, *args):
        calls.append(layer)
        return run(self, layer, *args)

    monkeypatch.setattr(PrefillStreamer, "run", counted)
    return calls


@pytest.mark.parametrize("fmt, options", FORMATS)
def test_a_streamed_prefill_gives_the_cpu_paths_logits(tiny_checkpoints, streamed_layers, fmt, options):
    path = tiny_checkpoints("qwen3_moe")
    common = dict(device="cpu", expert_backend="native", expert_format=fmt, gpu_experts_per_layer=3, **options)
    want = prompt_logits(load(path, prefill_streaming="off", **common).model)
    assert streamed_layers == []
    loaded = load(path, prefill_streaming="on", prefill_streaming_tokens=len(PROMPT), **common)
    got = prompt_logits(loaded.model)
    assert streamed_layers == loaded.model.moe_layers
    assert ((got - want).norm() / want.norm()).item() < 2e-2


def test_a_prefill_streamed_in_parts_gives_the_cpu_paths_logits(tiny_checkpoints, streamed_layers, monkeypatch):
    path = tiny_checkpoints("qwen3_moe")
    common = dict(device="cpu", expert_backend="native", expert_format="int8", gpu_experts_per_layer=3)
    want = prompt_logits(load(path, prefill_streaming="off", **common).model)
    monkeypatch.setattr(streamed_prefill, "SLOT_BYTES", 1)  # a part per expert
    loaded = load(path, prefill_streaming="on", prefill_streaming_tokens=len(PROMPT), **common)
    streamer = loaded.model.experts._layers[loaded.model.moe_layers[0]].streamer
    assert len(streamer.order) == sum(len(h.parts) for h in streamer.layers.values()) > len(streamer.layers)
    got = prompt_logits(loaded.model)
    assert streamed_layers == loaded.model.moe_layers
    assert ((got - want).norm() / want.norm()).item() < 2e-2


def test_steps_below_the_threshold_stay_on_the_cpu_engine(tiny_checkpoints, streamed_layers):
    path = tiny_checkpoints("qwen3_moe")
    common = dict(device="cpu", expert_backend="native", expert_format="int8", gpu_experts_per_layer=3)
    want = prompt_logits(load(path, prefill_streaming="off", **common).model)
    loaded = load(path, prefill_streaming="on", prefill_streaming_tokens=len(PROMPT) + 1, **common)
    assert torch.equal(prompt_logits(loaded.model), want)
    assert streamed_layers == []


def test_deferred_experts_stream_too(tiny_checkpoints, streamed_layers):
    path = tiny_checkpoints("qwen3_moe")
    common = dict(device="cpu", expert_backend="native", expert_format="int8", gpu_experts_per_layer=3,
                  deferred_experts=1)
    want = prompt_logits(load(path, prefill_streaming="off", **common).model)
    loaded = load(path, prefill_streaming="on", prefill_streaming_tokens=len(PROMPT), **common)
    got = prompt_logits(loaded.model)
    assert streamed_layers == [0, 1]  # each layer once, for its own experts and its deferred one
    assert ((got - want).norm() / want.norm()).item() < 2e-2
