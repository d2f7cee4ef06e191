import math
from types import SimpleNamespace

import pytest

from hybridmoe.bench.fit import depth_fits, fit_line
from hybridmoe.errors import HybridMoEError


def test_fit_line_is_least_squares_with_its_largest_residual():
    fit = fit_line([(1, 3.0), (2, 5.0), (3, 7.5)])  # y ~ 0.75 + 2.25 x
    assert fit.per_layer == pytest.approx(2.25) and fit.fixed == pytest.approx(2.0 / 3)
    assert fit.max_residual == pytest.approx(1 / 6)
    assert fit.at(10) == pytest.approx(2.0 / 3 + 22.5)


def test_fit_line_needs_two_depths():
    with pytest.raises(HybridMoEError, match=r"at least two different depths, got \[4\]"):
        fit_line([(4, 1.0), (4, 2.0)])


def result(label: str, moe: int, decode_s: float, ttft_s: dict, floor_per_layer_s: float):
    floor = SimpleNamespace(layers=[None] * moe, per_moe_layer_seconds=lambda: floor_per_layer_s)
    return SimpleNamespace(label=label, model_layers=moe, decode_s=decode_s, ttft_s=ttft_s, floor=floor)


def test_depth_fits_extrapolate_decode_and_prefill_per_label():
    # 2 ms fixed + 0.3 ms per layer; TTFT of 512 tokens 10 ms + 5 ms per layer; 2048 measured at 4 only
    rows = [result("int4", 4, 3.2e-3, {512: 30e-3, 2048: 0.1}, 0.12e-3),
            result("bf16", 4, 9e-3, {512: 40e-3}, 0.5e-3),
            result("int4", 16, 6.8e-3, {512: 90e-3}, 0.13e-3)]
    (fit,) = depth_fits(rows, full_layers=48, full_moe_layers=48)  # bf16 has one depth: no fit
    assert fit.label == "int4" and fit.depths == [4, 16] and list(fit.ttft) == [512]
    assert fit.decode_s == pytest.approx(2e-3 + 48 * 0.3e-3)
    assert fit.prefill_tok_s[512] == pytest.approx(512 / (10e-3 + 48 * 5e-3))
    assert fit.floor_s == pytest.approx(48 * 0.13e-3)  # the deepest measurement's floor per layer
    assert fit.to_json()["decode_over_floor"] == pytest.approx(fit.decode_s / fit.floor_s)


def test_a_fit_that_falls_with_depth_gives_no_full_depth_figure():
    # TTFT of 512 tokens 60 ms at 4 layers but 40 ms at 12 (noise): extended to 48 layers it would be negative
    rows = [result("int4", 4, 3.2e-3, {512: 60e-3}, 0.12e-3), result("int4", 12, 5.6e-3, {512: 40e-3}, 0.12e-3)]
    (fit,) = depth_fits(rows, full_layers=48, full_moe_layers=48)
    assert fit.ttft[512].at(48) < 0 and math.isnan(fit.prefill_tok_s[512])
    assert fit.decode_s == pytest.approx(2e-3 + 48 * 0.3e-3)  # decode rises with depth: still extrapolated
    assert fit.to_json()["prefill_tok_s"] == {512: None}
    # within the depths measured the same falling fit still interpolates
    (at_12,) = depth_fits(rows, full_layers=12, full_moe_layers=12)
    assert at_12.prefill_tok_s[512] == pytest.approx(512 / 40e-3)
