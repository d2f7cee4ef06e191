import pytest

from hybridmoe.bench_layers import LayerTimes


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
