"""Per-layer decode time, so that a model cut to fewer layers reports full-depth figures.

One eager decode run (no CUDA graph) with a timer around every decoder layer: CUDA events on the
GPU (no synchronization inside the step), wall clock on the CPU. What the layers leave of the
step's time is the non-layer part (embedding, final norm, lm_head, sampling, step overhead).
Full depth = non-layer part + each full-depth layer at its kind's mean time (dense / MoE), scaled
by (measured step time / eager step time) so that a graph-replayed run extrapolates as itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


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

    def full_depth_s(self, measured_step_s: float, dense_layers: int, moe_layers: int) -> float:
        """A decode step of the full model, from this one's measured step time."""
        eager = self.non_layer_s + dense_layers * self.mean_s(False) + moe_layers * self.mean_s(True)
        return eager * measured_step_s / self.step_s

    def to_json(self) -> dict:
        return {"eager_step_s": self.step_s, "non_layer_s": self.non_layer_s,
                "dense_layer_s": self.mean_s(False) if len(self.layer_s) > len(self.moe_layers) else None,
                "moe_layer_s": self.mean_s(True), "layer_s": {str(k): v for k, v in self.layer_s.items()}}


class _LayerTimer:
    """Forward hooks around each decoder layer that time single-token (decode) calls."""

    def __init__(self, layers: torch.nn.ModuleList, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[list[tuple]] = [[] for _ in layers]  # per layer: (start, end) per decode call
        self.handles = []
        for i, layer in enumerate(layers):
            self.handles.append(layer.register_forward_pre_hook(self._pre(i)))
            self.handles.append(layer.register_forward_hook(self._post(i)))

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _pre(self, i):
        def hook(module, args):
            if args[0].shape[0] == 1:
                self.marks[i].append([self._now(), None])
        return hook

    def _post(self, i):
        def hook(module, args, output):
            if args[0].shape[0] == 1:
                self.marks[i][-1][1] = self._now()
        return hook

    def mean_seconds(self) -> dict[int, float]:
        if self.cuda:
            torch.cuda.synchronize()
            span = lambda a, b: a.elapsed_time(b) / 1e3  # noqa: E731 (ms -> s)
        else:
            span = lambda a, b: b - a  # noqa: E731
        return {i: sum(span(a, b) for a, b in m) / len(m) for i, m in enumerate(self.marks) if m}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def measure_layer_times(engine, prompt: list[int], gen_len: int) -> LayerTimes:
    """Decode gen_len tokens after `prompt` eagerly with every decoder layer timed (graphs off for this run)."""
    from hybridmoe.sampling_params import SamplingParams

    runner, model = engine.runner, engine.runner.model
    graphs, runner.cuda_graph = runner.cuda_graph, False
    timer = _LayerTimer(model.model.layers, runner.device)
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
        runner.cuda_graph = graphs
    return LayerTimes(sum(steps) / len(steps), layer_s, list(model.moe_layers))
