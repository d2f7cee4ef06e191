"""Where a hybrid decode step's time goes, from what the CUDA handoff's polling thread saw.

On the stream_mem_ops path the polling thread knows, per MoE layer whose CPU experts it ran, when it
saw the go word and when the CPU work ended (done written); CudaHandoff.take_stats sums them. A decode
step of n such layers is then

    first go  |CPU 0| gap 0 |CPU 1| gap 1 | ... |CPU n-1|  ... next step
              <------------------ the step --------------------->

CPU: the layer's CPU work. gap: one layer's done -> the next layer's go seen: the stream sees done,
copies the output back, runs the next layer's GPU work (attention, router, GPU experts' tail),
copies its rows out and writes go.
The rest of the measured step time (before the first go and after the last done: embedding, the
first layer's attention, final norm, lm_head, sampling, the Python step) is per token, not per
layer. With the next step launched before the token is read (ModelRunner.lookahead, the default for
plain greedy decoding) the Python step overlaps the device's work and shrinks the rest. All on the
host's clock; the poller's reaction time ("late": since its previous look at the flags) bounds how late
it saw each go.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class StepAnatomy:
    steps: int
    """Decode steps the polling thread served (runs of layers in increasing order)."""
    layers_per_step: float
    """MoE layers whose CPU experts ran through the handoff, per step."""
    cpu_us: float
    """CPU work per layer (go seen -> done written)."""
    first_cpu_us: float
    """The same for a step's first layer alone (after the gap between steps)."""
    gap_us: float | None
    """Within a step, one layer's done -> the next layer's go seen; None with one layer per step."""
    late_us: float
    """How late the poller may have seen a go (its reaction time), per layer."""
    first_late_us: float
    step_us: float
    """The measured decode step (wall clock, per token)."""
    handoffs: int = 1
    """Handoffs that served the steps (2 with deferred experts: their CPU work falls inside the other's gaps)."""

    @property
    def gaps_per_step_us(self) -> float:
        return (self.layers_per_step - 1) * (self.gap_us or 0.0)

    @property
    def rest_us(self) -> float | None:
        """The step's time outside its layers' CPU work and the gaps between them; None with several
        handoffs (one's CPU work runs inside the other's gaps: the parts overlap)."""
        if self.handoffs > 1:
            return None
        return self.step_us - self.layers_per_step * self.cpu_us - self.gaps_per_step_us

    def to_json(self) -> dict:
        return {**asdict(self), "rest_us": self.rest_us}


def step_anatomy(stats: list[dict | None], step_s: float) -> StepAnatomy | None:
    """One StepAnatomy from the take_stats() of each handoff of a model (the deferred experts' handoff
    adds its layers to the same steps), over decode steps of step_s seconds each; None when no
    handoff ran on the stream_mem_ops path or none served a step."""
    stats = [s for s in stats if s is not None]
    total = {k: sum(s[k] for s in stats) for k in stats[0]} if stats else {}
    steps = max((s["steps"] for s in stats), default=0)
    if not steps or not total["layers"]:
        return None
    n = total["layers"]
    return StepAnatomy(
        steps=steps, layers_per_step=n / steps, cpu_us=total["cpu_us"] / n,
        first_cpu_us=total["first_cpu_us"] / total["steps"],
        gap_us=total["between_us"] / total["gaps"] if total["gaps"] else None,
        late_us=total["late_us"] / n, first_late_us=total["first_late_us"] / total["steps"],
        step_us=step_s * 1e6, handoffs=sum(1 for s in stats if s["layers"]))
