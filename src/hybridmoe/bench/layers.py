"""Per-layer decode (and prefill) time, so that a model cut to fewer layers reports full-depth figures.

One eager decode run (no CUDA graph) with a mark before every decoder layer and before the final
norm: CUDA events on the GPU (no synchronization inside the step), wall clock on the CPU. A layer
runs from its mark to the next (deferred experts joined after it included). What the layers leave
of the step's time is the non-layer part (embedding, final norm, lm_head, sampling, step overhead).
Full depth = non-layer part + each full-depth layer at its kind's mean time (dense / MoE), scaled
by (measured step time / eager step time) so that a graph-replayed run extrapolates as itself.

A prompt's prefill the same way (measure_prefill_layer_times): its layers summed over the prompt's steps,
the rest of its time to the first token the non-layer part; a cut DeepSeek-V3 (1 dense layer, 1 MoE) then
extrapolates to 3 dense and 58 MoE layers each at its own kind's time, not at their mean.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from hybridmoe.bench.e2e import _measure
from hybridmoe.sampling_params import SamplingParams


@dataclass(frozen=True)
class LayerTimes:
    step_s: float
    """Mean eager decode step."""
    layer_s: dict[int, float]
    """Decoder layer -> mean seconds per decode step."""
    moe_layers: list[int]

    @property
    def non_layer_s(self) -> float:
        return max(self.step_s - sum(self.layer_s.values()), 0.0)

    def mean_s(self, moe: bool) -> float:
        """Mean time of a MoE (or dense) layer; a kind the cut model lacks takes the other kind's."""
        times = [t for i, t in self.layer_s.items() if (i in self.moe_layers) == moe]
        times = times or list(self.layer_s.values())
        return sum(times) / len(times)

    @property
    def dense_layer_s(self) -> float | None:
        """Mean time of a dense layer; None when the cut model has none."""
        return self.mean_s(False) if len(self.layer_s) > len(self.moe_layers) else None

    def full_depth_s(self, measured_step_s: float, dense_layers: int, moe_layers: int) -> float:
        """A decode step of the full model, from this one's measured step time."""
        eager = self.non_layer_s + dense_layers * self.mean_s(False) + moe_layers * self.mean_s(True)
        return eager * measured_step_s / self.step_s

    def to_json(self) -> dict:
        return {"eager_step_s": self.step_s, "non_layer_s": self.non_layer_s,
                "dense_layer_s": self.dense_layer_s,
                "moe_layer_s": self.mean_s(True), "layer_s": {str(k): v for k, v in self.layer_s.items()}}


class _LayerTimer:
    """Pre-forward hooks on each decoder layer and on the final norm that mark single-token (decode) calls,
    or with prefill the others (a prompt's steps: the whole prompt, or each of its chunks).

    A layer's time runs from its own mark to the next one, so it includes what the backend does after it
    (after_layer: joining deferred experts), which is per-layer work a full-depth model repeats."""

    def __init__(self, layers: torch.nn.ModuleList, norm: torch.nn.Module, device: torch.device,
                 prefill: bool = False):
        self.cuda, self.prefill = device.type == "cuda", prefill
        self.steps: list[list] = []  # per step: a mark before each layer, then one before the norm
        self.handles = [m.register_forward_pre_hook(self._mark(first=i == 0))
                        for i, m in enumerate([*layers, norm])]

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _mark(self, first: bool):
        def hook(module, args):
            if (args[0].shape[0] != 1) != self.prefill:
                return
            if first:
                self.steps.append([])
            self.steps[-1].append(self._now())
        return hook

    def mean_seconds(self) -> dict[int, float]:
        return {i: t / len(self.steps) for i, t in self.total_seconds().items()}

    def total_seconds(self) -> dict[int, float]:
        if self.cuda:
            torch.cuda.synchronize()
            span = lambda a, b: a.elapsed_time(b) / 1e3  # noqa: E731 (ms -> s)
        else:
            span = lambda a, b: b - a  # noqa: E731
        layers = len(self.handles) - 1
        totals = [0.0] * layers
        for marks in self.steps:
            for i in range(layers):
                totals[i] += span(marks[i], marks[i + 1])
        return dict(enumerate(totals))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def measure_layer_times(engine, prompt: list[int], gen_len: int) -> LayerTimes:
    """Decode gen_len tokens after `prompt` eagerly with every decoder layer timed (graphs off for this run)."""
    runner, model = engine.runner, engine.runner.model
    # each step timed alone: eager, and no step launched before the previous one's token is read
    (graphs, ahead), runner.cuda_graph, runner.lookahead = (runner.cuda_graph, runner.lookahead), False, False
    timer = _LayerTimer(model.model.layers, model.model.norm, runner.device)
    steps: list[float] = []
    try:
        engine.add_request(prompt, SamplingParams(max_tokens=gen_len, temperature=0, ignore_eos=True))
        engine.step()  # the prompt (not timed as a decode step)
        while engine.has_unfinished():
            start = time.perf_counter()
            engine.step()  # the sampler reads the token on the host: the step is finished here
            steps.append(time.perf_counter() - start)
        layer_s = timer.mean_seconds()
    finally:
        timer.remove()
        runner.cuda_graph, runner.lookahead = graphs, ahead
    return LayerTimes(sum(steps) / len(steps), layer_s, list(model.moe_layers))


def measure_prefill_layer_times(engine, prompt: list[int]) -> LayerTimes:
    """Prefill `prompt` (one request, its first token only) with every decoder layer timed: step_s is its
    time to the first token, layer_s each layer's time summed over the prompt's steps (chunks)."""
    model = engine.runner.model
    timer = _LayerTimer(model.model.layers, model.model.norm, engine.runner.device, prefill=True)
    try:
        ttft = _measure(engine, [prompt], 1)["ttft_mean_s"]
        layer_s = timer.total_seconds()
    finally:
        timer.remove()
    return LayerTimes(ttft, layer_s, list(model.moe_layers))
