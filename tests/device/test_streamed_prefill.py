"""Long prefill steps streamed to a real GPU (experts/streamed_prefill.py): packed bytes dequantized on
CUDA (the Triton pass) equal the CPU engine's weights bit for bit; several layers in a row, the next
one's copy in flight on the side stream while the current one computes, equal a float32 reference (a
missing wait would read a half-copied slot); a step with the layer's GPU-resident experts too; the costs measured
at load are sane; the copies come from registered (page-locked) host memory, unregistered when
a streamer goes; the device memory a step takes stays within what placement sets aside; a whole model's
next-token log-probabilities after a streamed prompt match the CPU path's.
"""

import gc
import math

import pytest
import torch
import torch.nn.functional as F

from hybridmoe import LLM, SamplingParams
from hybridmoe.checkpoint.make import make_checkpoint
from hybridmoe.experts.hybrid import weighted_experts
from hybridmoe.experts.packed_torch import PackedLayout
from hybridmoe.experts.streamed_prefill import (
    PrefillStreamer,
    device_bytes,
    measured_costs,
)

pytestmark = [pytest.mark.device,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
cpu_experts = pytest.importorskip("hybridmoe.experts.cpu_experts")

E, H, I = 16, 1024, 512  # 16 x 1.5M weights: a copy long enough for a race to show


def _engine(fmt: str, seed: int, zero_points: bool = False):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g), torch.randn(E, H, I, generator=g))
    return cpu_experts.CpuExperts(*(t * 0.05 for t in w), format=fmt, group_size=64, zero_points=zero_points)


def _step(T: int, K: int, seed: int):
    """A step's inputs on CUDA: x [T, H], ids [T, K] (K distinct experts a token), weights [T, K], mask [T, K]
    all set."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).cuda()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).cuda()
    w = torch.rand(T, K, generator=g).cuda()
    return x, ids, w, torch.ones(T, K, dtype=torch.bool, device="cuda")


@pytest.mark.parametrize("fmt, zero_points", [("bf16", False), ("int8", False), ("int4", False), ("int4", True)])
def test_dequantized_on_cuda_equals_the_engines_weights(fmt, zero_points):
    engine = _engine(fmt, 0, zero_points)
    state = engine.packed_state()
    buffers = {n: torch.from_numpy(a).view(torch.uint8).cuda() for n, a in state["buffers"].items()}
    for dtype in (torch.float32, torch.bfloat16):
        got = PackedLayout(state).dequantize(buffers, torch.tensor([3, 15], device="cuda"), dtype)
        for i, e in enumerate((3, 15)):
            for mine, theirs in zip(got, engine.dequantized(e)):
                assert torch.equal(mine[i].cpu(), theirs.to(dtype))


def test_layers_in_a_row_with_prefetch_equal_the_reference():
    engines = {layer: _engine("int8", layer) for layer in range(4)}
    streamer = PrefillStreamer(engines, "cuda", min_tokens=1)
    x, ids, w, mask = _step(300, 4, seed=5)
    refs = {}
    for layer, engine in engines.items():
        deq = [torch.stack(m).cuda() for m in zip(*(engine.dequantized(e) for e in range(E)))]
        refs[layer] = weighted_experts(x, *deq, ids, w, mask, F.silu)
    for _ in range(2):  # the second pass copies every layer again into reused slots
        streamer.slot_layer = [None, None]
        outs = {layer: streamer.run(layer, x, ids, w, mask, F.silu) for layer in engines}
        for layer, out in outs.items():
            torch.testing.assert_close(out, refs[layer], atol=2e-4, rtol=2e-4)
    assert all(host.registered for host in streamer.layers.values())
    streamer.close()
    assert not any(host.registered for host in streamer.layers.values())


def test_layers_in_parts_with_prefetch_equal_the_reference(monkeypatch):
    from hybridmoe.experts import streamed_prefill

    engines = {layer: _engine("int4", layer) for layer in range(3)}
    nbytes = streamed_prefill._HostLayer(engines[0]).nbytes
    monkeypatch.setattr(streamed_prefill, "SLOT_BYTES", nbytes // 2 - 1)
    streamer = PrefillStreamer(engines, "cuda", min_tokens=1)  # 3 parts of 6, 6 and 4 experts a layer
    assert streamer.keys[0] == [(0, 0), (0, 1), (0, 2)]
    x, ids, w, mask = _step(300, 4, seed=5)
    for _ in range(2):  # the second pass from the slots as the first left them
        for layer, engine in engines.items():
            deq = [torch.stack(m).cuda() for m in zip(*(engine.dequantized(e) for e in range(E)))]
            torch.testing.assert_close(streamer.run(layer, x, ids, w, mask, F.silu),
                                       weighted_experts(x, *deq, ids, w, mask, F.silu), atol=2e-4, rtol=2e-4)
    streamer.close()


def test_a_step_with_resident_experts_equals_the_reference():
    engine = _engine("int4", 7)
    streamer = PrefillStreamer({0: engine}, "cuda", min_tokens=1)
    g = torch.Generator().manual_seed(6)
    T, K, G = 300, 4, 3
    x = (torch.randn(T, H, generator=g) * 0.5).cuda()
    on_cpu = (torch.rand(T, K, generator=g) < 0.8).cuda()
    ids = torch.where(on_cpu, torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).cuda(),
                      torch.randint(0, G, (T, K), generator=g).cuda())  # local to each side
    w = torch.rand(T, K, generator=g).cuda()
    resident = tuple((torch.randn(G, *shape, generator=g) * 0.05).cuda() for shape in ((I, H), (I, H), (H, I)))
    deq = [torch.stack(m).cuda() for m in zip(*(engine.dequantized(e) for e in range(E)))]
    want = weighted_experts(x, *deq, ids, w, on_cpu, F.silu) + weighted_experts(x, *resident, ids, w, ~on_cpu, F.silu)
    for _ in range(2):  # the second time from the slot as the first left it
        got = streamer.run(0, x, ids, w, on_cpu, F.silu, resident)
        assert ((got - want).norm() / want.norm()).item() < 2e-2
    streamer.close()


def test_costs_measured_on_the_gpu_are_the_copy_and_the_work_of_a_layer():
    engines = {layer: _engine("int4", layer) for layer in range(2)}
    streamer = PrefillStreamer(engines, "cuda", min_tokens=1)
    costs, why = measured_costs(streamer, top_k=4, num_experts=2 * E)
    gbps = streamer.layers[0].nbytes / costs.copy / 1e9
    assert 1 < gbps < 200, why  # host-to-device over PCIe (or NVLink-C2C), registered memory
    assert 0 < costs.stream(512) < 1 and costs.cpu(512) > 0 and costs.cpu_per_token > 0, why
    assert streamer.slot_layer == [None, None]
    streamer.close()


def test_a_step_stays_within_the_device_memory_set_aside():
    engines = {layer: _engine("int4", layer) for layer in range(2)}
    T, K = 512, 4
    warm = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
    warm @ warm  # cuBLAS's workspace, allocated once per process, is not streaming's
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    streamer = PrefillStreamer(engines, "cuda", min_tokens=1)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).cuda()
    w = torch.rand(T, K, device="cuda")
    mask = torch.ones(T, K, dtype=torch.bool, device="cuda")
    inputs = sum(t.numel() * t.element_size() for t in (x, ids, w, mask))
    for layer in engines:
        streamer.run(layer, x, ids, w, mask, F.silu)
    torch.cuda.synchronize()
    used = torch.cuda.max_memory_allocated() - before - inputs
    assert used <= device_bytes(streamer.layers[0].nbytes, E, H, I, K, T)


def test_a_new_streamer_over_new_engines_after_one_is_dropped():
    # engines freed and new ones mapped (often at the same addresses): the old registration must be gone
    T, K = 64, 2
    x = torch.randn(T, H, device="cuda")
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).cuda()
    w = torch.rand(T, K, device="cuda")
    mask = torch.ones(T, K, dtype=torch.bool, device="cuda")
    for seed in (1, 2, 3):
        engines = {layer: _engine("int4", seed + 10 * layer) for layer in range(3)}
        streamer = PrefillStreamer(engines, "cuda", min_tokens=1)
        outs = [streamer.run(layer, x, ids, w, mask, F.silu) for layer in engines]
        assert all(host.registered for host in streamer.layers.values())
        for layer, engine in engines.items():
            deq = [torch.stack(m).cuda() for m in zip(*(engine.dequantized(e) for e in range(E)))]
            torch.testing.assert_close(outs[layer], weighted_experts(x, *deq, ids, w, mask, F.silu),
                                       atol=2e-4, rtol=2e-4)
        del streamer, engines, outs
        gc.collect()


def _first_token_logprobs(llm, ids: list[int]) -> dict[int, float]:
    """Token id -> log-probability of the 20 likeliest first tokens after the prompt ids."""
    engine = llm.engine
    engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=20))
    top = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.new_logprobs:
                top = dict(out.new_logprobs[0].top)
    return top


def test_a_streamed_prefill_on_cuda_gives_the_cpu_paths_next_token(tmp_path, monkeypatch):
    streamed, run = [], PrefillStreamer.run
    monkeypatch.setattr(PrefillStreamer, "run", lambda self, layer, *a: streamed.append(layer) or run(self, layer, *a))
    make_checkpoint("qwen3_moe", "tiny", tmp_path, dtype="fp32", seed=1, progress=False)
    ids = torch.randint(5, 500, (64,), generator=torch.Generator().manual_seed(2)).tolist()
    common = dict(device="cuda", expert_backend="native", expert_format="int8", gpu_experts_per_layer=0,
                  gpu_memory_budget=1 << 30)
    want = _first_token_logprobs(LLM(tmp_path, prefill_streaming="off", **common), ids)
    llm = LLM(tmp_path, prefill_streaming="on", prefill_streaming_tokens=32, **common)
    streamed.clear()
    got = _first_token_logprobs(llm, ids)
    assert streamed == [0, 1]
    assert all(math.isfinite(v) for v in [*want.values(), *got.values()])
    best = max(got, key=got.get)
    assert best in sorted(want, key=want.get)[-5:]  # the same token, or a near-tie among the top 5
    shared = set(want) & set(got)
    assert len(shared) >= 15 and max(abs(want[t] - got[t]) for t in shared) < 0.02
