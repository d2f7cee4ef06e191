import pytest

from hybridmoe.bench.floor import decode_floor, floor_ratio
from hybridmoe.checkpoint.make import make_checkpoint
from hybridmoe.config import EngineConfig
from hybridmoe.engine.llm_engine import LLMEngine
from hybridmoe.experts.expert_bytes import cpu_expert_bytes

# tiny qwen3: 2 MoE layers, E=8 experts, K=2 per token, H=64, I=32


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3")
    make_checkpoint("qwen3_moe", "tiny", d, progress=False)
    return d


def _floor(checkpoint, **options):
    engine = LLMEngine(checkpoint, EngineConfig(device="cpu", max_num_seqs=1, cache_dir="", **options))
    return decode_floor(engine.runner.model, bandwidth=1e9, bandwidth_method="given")


@pytest.mark.parametrize("fmt,group", [("bf16", 128), ("int8", 128), ("int4", 32)])
def test_floor_counts_the_packed_bytes_of_k_experts_per_layer(checkpoint, fmt, group):
    floor = _floor(checkpoint, expert_backend="native", expert_format=fmt, expert_group_size=group)
    per_expert = cpu_expert_bytes(fmt, 32, 64, group)  # the layout's own size formula
    assert [layer.cpu_bytes_per_expert for layer in floor.layers] == [per_expert] * 2
    assert floor.cpu_experts_per_token == 2 * 2
    assert floor.bytes_per_token == 2 * 2 * per_expert
    assert floor.seconds == pytest.approx(4 * per_expert / 1e9)


def test_floor_leaves_out_the_gpu_share_of_the_routing(checkpoint):
    # the CPU stands in for the GPU: 2 of each layer's 8 experts "on the GPU", one deferred (still CPU work)
    floor = _floor(checkpoint, expert_backend="native", expert_format="bf16", gpu_experts_per_layer=2,
                   deferred_experts=1)
    assert [(layer.on_gpu, layer.gpu_share) for layer in floor.layers] == [(2, 0.25)] * 2
    assert floor.cpu_experts_per_token == pytest.approx(2 * 2 * 0.75)
    assert floor.bytes_per_token == pytest.approx(2 * 2 * 0.75 * 3 * 32 * 64 * 2)


def test_torch_reference_experts_on_the_cpu_read_their_float_weights(checkpoint):
    floor = _floor(checkpoint, expert_backend="torch", dtype="float32")
    assert floor.bytes_per_token == 2 * 2 * 3 * 32 * 64 * 4


def test_ratio_is_nan_when_no_expert_is_read_on_the_cpu(checkpoint):
    floor = _floor(checkpoint, expert_backend="native", expert_format="bf16", gpu_experts_per_layer=8)
    assert floor.seconds == 0
    assert floor_ratio(0.01, floor) != floor_ratio(0.01, floor)  # nan
    with_cpu = _floor(checkpoint, expert_backend="native", expert_format="bf16")
    assert floor_ratio(2 * with_cpu.seconds, with_cpu) == pytest.approx(2.0)


def test_decode_routing_counts_the_decode_steps_and_weights_the_floor(checkpoint):
    from hybridmoe.bench.floor import decode_routing

    engine = LLMEngine(checkpoint, EngineConfig(device="cpu", max_num_seqs=1, cache_dir="", expert_backend="native",
                                                expert_format="bf16", gpu_experts_per_layer=2))
    model = engine.runner.model
    backend = model.experts
    stats = decode_routing(engine, list(range(5, 21)), gen_len=6)
    assert model.experts is backend and all(getattr(m, "experts", backend) is backend for m in model.modules())
    assert stats.tokens == 5  # the 5 steps after the prompt's (which yields the first token)
    assert {layer: sum(c) for layer, c in stats.counts.items()} == {0: 5 * 2, 1: 5 * 2}
    floor = decode_floor(model, 1e9, "given", stats)
    for layer in floor.layers:  # experts 0 and 1 are the GPU ones (no profile: lowest ids)
        c = stats.counts[layer.layer]
        assert layer.gpu_share == (c[0] + c[1]) / 10
