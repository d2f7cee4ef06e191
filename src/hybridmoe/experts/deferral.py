"""Expert deferral: part of layer L's routed experts joins the residual one layer later.

Each token's K lowest-weighted routed experts of MoE layer L are computed on the CPU while
layer L+1's attention (and router, shared experts, GPU experts) runs; their weighted output is
added to the residual stream after decoder layer L+1, or, when L is the last layer, before the
final norm. The CPU thus never idles between layers and the GPU never waits for the CPU's
slowest experts. K = 0 is the exact model. T tokens, K routed experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def split_deferred(topk_ids: torch.Tensor, topk_weights: torch.Tensor, deferred: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """[T, K] ids and weights -> (ids, weights) [T, K - deferred] run now, (ids, weights) [T, deferred] later.

    Deferred are each token's `deferred` lowest weights (ties: the later slot is deferred). All four come
    contiguous (column slices would be strided views, which kernels that read rows as laid out misread).
    """
    order = torch.sort(topk_weights, dim=1, descending=True, stable=True).indices
    ids, weights = topk_ids.gather(1, order), topk_weights.gather(1, order)
    keep = topk_ids.shape[1] - deferred
    return tuple(t.contiguous() for t in (ids[:, :keep], weights[:, :keep], ids[:, keep:], weights[:, keep:]))


@dataclass
class _Deferred:
    layer: int
    result: object
    """The pending partial computation: join_cpu() lets its CPU part finish; add_to(hidden [T, H]) ->
    hidden + its output [T, H]."""


class DeferredOutputs:
    """Deferred expert outputs in flight, joined into the residual at the right decoder layer."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self._pending: list[_Deferred] = []

    def add(self, layer: int, result) -> None:
        self._pending.append(_Deferred(layer, result))

    def layers(self) -> list[int]:
        """MoE layers whose deferred output has not joined the residual yet."""
        return [d.layer for d in self._pending]

    def take_latest_before(self, layer: int):
        """The pending result of the latest MoE layer before `layer`, no longer pending (its caller joins it
        into the residual); None if there is none."""
        earlier = [d for d in self._pending if d.layer < layer]
        if not earlier:
            return None
        latest = max(earlier, key=lambda d: d.layer)
        self._pending = [d for d in self._pending if d is not latest]
        return latest.result

    def drain_cpu(self) -> None:
        """Let the CPU finish every deferred computation now (before it starts another layer's)."""
        for d in self._pending:
            d.result.join_cpu()

    def join(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """hidden after decoder layer `layer`, plus the deferred outputs due there (hidden itself if none)."""
        due = [d for d in self._pending if d.layer < layer or layer == self.num_layers - 1]
        if not due:
            return hidden
        self._pending = [d for d in self._pending if all(d is not x for x in due)]
        for d in due:
            hidden = d.result.add_to(hidden)
        return hidden

    def discard(self) -> None:
        """Drop what an interrupted forward left (its CPU work is waited for, its result unused)."""
        self.drain_cpu()
        self._pending.clear()
