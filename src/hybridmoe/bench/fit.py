"""Full-depth figures from the same configuration measured at two or more depths of a cut model.

A decode step (and a prompt's time to first token) is modelled as fixed + per_layer x MoE layers, fitted
by least squares over the measured depths: the fixed part (embedding, lm_head, sampling, the Python
step, the cut model's dense layers) is measured, not assumed to scale with anything. Full depth = the
fit at the full model's MoE layer count. The floor scales with the MoE layers (per-layer floor of the
deepest measurement).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridmoe.errors import HybridMoEError


@dataclass(frozen=True)
class LinearFit:
    fixed: float
    per_layer: float
    max_residual: float
    """Largest |measured - fitted| over the points (0 with two depths: the line goes through both)."""
    deepest: float
    """The largest x measured."""

    def at(self, layers: float) -> float:
        return self.fixed + self.per_layer * layers

    def at_depth(self, layers: float) -> float:
        """at(layers), or nan where a fit that falls with depth is extended past the deepest measurement: such a
        fit is the depths' noise and says nothing deeper (extended far enough, it gives a negative time)."""
        return math.nan if self.per_layer < 0 and layers > self.deepest else self.at(layers)


def fit_line(points: list[tuple[float, float]]) -> LinearFit:
    """Least-squares y = fixed + per_layer x over (x, y) points with at least two distinct x."""
    xs = {x for x, _ in points}
    if len(xs) < 2:
        raise HybridMoEError(f"a fit over depths needs at least two different depths, got {sorted(xs)}")
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    fixed = my - slope * mx
    return LinearFit(fixed, slope, max(abs(y - (fixed + slope * x)) for x, y in points), max(xs))


@dataclass(frozen=True)
class DepthFit:
    label: str
    depths: list[int]
    """Decoder layers of each measured cut model."""
    full_moe_layers: int
    full_layers: int
    decode: LinearFit
    """Seconds per decoded token over MoE layers."""
    ttft: dict[int, LinearFit]
    """Prompt length -> seconds to the first token over MoE layers (lengths measured at every depth)."""
    floor_per_moe_layer_s: float

    @property
    def decode_s(self) -> float:
        return self.decode.at_depth(self.full_moe_layers)

    @property
    def floor_s(self) -> float:
        return self.floor_per_moe_layer_s * self.full_moe_layers

    @property
    def decode_over_floor(self) -> float | None:
        """Full-depth decode time / floor (None when the floor is 0: GPU-bound)."""
        return self.decode_s / self.floor_s if self.floor_s > 0 else None

    @property
    def prefill_tok_s(self) -> dict[int, float]:
        """Prompt length -> tokens/s at full depth (nan where a falling fit would be extended)."""
        return {n: n / fit.at_depth(self.full_moe_layers) for n, fit in self.ttft.items()}

    def to_json(self) -> dict:
        fit = lambda f: {"fixed_s": f.fixed, "per_moe_layer_s": f.per_layer, "max_residual_s": f.max_residual}  # noqa: E731
        known = lambda v: None if v is None or math.isnan(v) else v  # noqa: E731  (JSON has no nan)
        return {"label": self.label, "depths": self.depths, "full_layers": self.full_layers,
                "full_moe_layers": self.full_moe_layers, "decode_fit": fit(self.decode),
                "ttft_fit": {n: fit(f) for n, f in self.ttft.items()}, "decode_s": known(self.decode_s),
                "decode_tok_s": known(1.0 / self.decode_s), "floor_s": self.floor_s,
                "decode_over_floor": known(self.decode_over_floor),
                "prefill_tok_s": {n: known(v) for n, v in self.prefill_tok_s.items()}}


def depth_fits(results: list, full_layers: int, full_moe_layers: int) -> list[DepthFit]:
    """One DepthFit per label measured at two or more depths (SuiteResults: decode_s, ttft_s, floor,
    model_layers), in the order the labels first appear."""
    by_label: dict[str, list] = {}
    for r in results:
        by_label.setdefault(r.label, []).append(r)
    fits = []
    for label, rows in by_label.items():
        if len({r.model_layers for r in rows}) < 2:
            continue
        moe = lambda r: len(r.floor.layers)  # noqa: E731 (the cut model's MoE layers)
        lens = set.intersection(*(set(r.ttft_s) for r in rows))
        deepest = max(rows, key=moe)
        fits.append(DepthFit(
            label, sorted(r.model_layers for r in rows), full_moe_layers, full_layers,
            decode=fit_line([(moe(r), r.decode_s) for r in rows]),
            ttft={n: fit_line([(moe(r), r.ttft_s[n]) for r in rows]) for n in sorted(lens)},
            floor_per_moe_layer_s=deepest.floor.per_moe_layer_seconds()))
    return fits
