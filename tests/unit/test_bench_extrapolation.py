import pytest

from hybridmoe.bench.layers import LayerTimes


def test_full_depth_is_non_layer_part_plus_each_layer_kind_at_its_mean():
    # 1 dense layer (0) + 2 MoE layers (1, 2): 1 ms + 2 x 3 ms of a 10 ms eager step leaves 3 ms non-layer
    lt = LayerTimes(step_s=10e-3, layer_s={0: 1e-3, 1: 2e-3, 2: 4e-3}, moe_layers=[1, 2])
    assert lt.non_layer_s == pytest.approx(3e-3)
    assert lt.mean_s(moe=True) == pytest.approx(3e-3) and lt.mean_s(moe=False) == pytest.approx(1e-3)
    # measured (graph) step 5 ms = half the eager one: the whole extrapolation scales by 1/2
    assert lt.full_depth_s(5e-3, dense_layers=3, moe_layers=58) == pytest.approx((3 + 3 * 1 + 58 * 3) * 1e-3 / 2)


def test_a_kind_the_cut_model_lacks_takes_the_other_kinds_time():
    lt = LayerTimes(step_s=4e-3, layer_s={0: 1e-3, 1: 1e-3}, moe_layers=[0, 1])
    assert lt.mean_s(moe=False) == pytest.approx(1e-3)
    assert lt.to_json()["dense_layer_s"] is None


def test_layer_timer_spans_every_decoder_layer_of_a_decode_step(tmp_path):
    from hybridmoe.bench.layers import measure_layer_times
    from hybridmoe.checkpoint.make import make_checkpoint
    from hybridmoe.config import EngineConfig
    from hybridmoe.engine.llm_engine import LLMEngine

    make_checkpoint("deepseek_v3", "tiny", tmp_path, progress=False)  # 3 layers, the first dense
    engine = LLMEngine(tmp_path, EngineConfig(device="cpu", max_num_seqs=1, expert_backend="torch"))
    model = engine.runner.model
    lt = measure_layer_times(engine, list(range(1, 9)), gen_len=4)
    assert sorted(lt.layer_s) == [0, 1, 2] and lt.moe_layers == [1, 2]
    assert all(t > 0 for t in lt.layer_s.values())
    assert 0 < sum(lt.layer_s.values()) < lt.step_s  # the layers are part of each step
    assert not any(m._forward_pre_hooks for m in [*model.model.layers, model.model.norm])  # hooks removed


def test_a_prefill_is_timed_per_layer_over_its_chunks(tmp_path, monkeypatch):
    from hybridmoe.bench import layers as bench_layers
    from hybridmoe.bench.layers import measure_prefill_layer_times
    from hybridmoe.checkpoint.make import make_checkpoint
    from hybridmoe.config import EngineConfig
    from hybridmoe.engine.llm_engine import LLMEngine

    make_checkpoint("deepseek_v3", "tiny", tmp_path, progress=False)  # 3 layers, the first dense
    engine = LLMEngine(tmp_path, EngineConfig(device="cpu", max_num_seqs=1, expert_backend="torch",
                                              max_num_batched_tokens=16))
    model = engine.runner.model
    steps = []
    total = bench_layers._LayerTimer.total_seconds
    monkeypatch.setattr(bench_layers._LayerTimer, "total_seconds", lambda self: (steps.append(len(self.steps)),
                                                                                  total(self))[1])
    lt = measure_prefill_layer_times(engine, list(range(1, 41)))  # 40 tokens: 3 steps of at most 16
    assert steps == [3]
    assert sorted(lt.layer_s) == [0, 1, 2] and lt.moe_layers == [1, 2]
    assert all(t > 0 for t in lt.layer_s.values()) and 0 < sum(lt.layer_s.values()) < lt.step_s
    assert not any(m._forward_pre_hooks for m in [*model.model.layers, model.model.norm])
