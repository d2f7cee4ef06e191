"""The routed experts under tensor parallelism: one expert engine, on rank 0, whose output every rank receives.

Every rank routes alike: the router is whole on every rank and its input, the hidden state after a row-parallel
all-reduce, is the same everywhere. Rank 0's backend (the native engine or the torch reference) holds every routed
expert and runs each MoE layer on its own hidden state; its output is then broadcast from rank 0 to the other
ranks, which hold no routed-expert weight at all. One broadcast per MoE layer is the whole exchange: the other
ranks wait in it while rank 0's experts run, and the shared experts (a row-parallel MLP, run between submit and
wait as the model orders them) run on every rank before it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from hybridmoe.distributed.parallel_state import TensorParallel
from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.base import ExpertBackend


class RankZeroExperts(ExpertBackend):
    """Rank 0's backend: the loader's calls go to `experts` (the backend that holds and runs the routed experts);
    wait() broadcasts each layer's output to the other ranks. Steps run eagerly (no fixed shapes, so no CUDA
    graph): the step's inputs reach the other ranks from the host (distributed/lockstep.py)."""

    def __init__(self, experts: ExpertBackend, tp: TensorParallel):
        self.experts, self.tp = experts, tp

    def set_layer(self, layer, gate_proj, up_proj, down_proj):
        self.experts.set_layer(layer, gate_proj, up_proj, down_proj)

    def set_layer_experts(self, layer, experts, num_experts: int):
        self.experts.set_layer_experts(layer, experts, num_experts)

    def set_layer_biases(self, layer, gate_bias, up_bias, down_bias):
        self.experts.set_layer_biases(layer, gate_bias, up_bias, down_bias)

    def takes_fp8_codes(self) -> bool:
        return self.experts.takes_fp8_codes()

    def takes_mxfp4_codes(self) -> bool:
        return self.experts.takes_mxfp4_codes()

    def int4_codes_group(self, symmetric: bool = False) -> int | None:
        return self.experts.int4_codes_group(symmetric)

    def set_layer_codes(self, layer, gate_proj, up_proj, down_proj):
        self.experts.set_layer_codes(layer, gate_proj, up_proj, down_proj)

    def layers(self) -> list[int]:
        return self.experts.layers()

    def submit(self, layer, hidden, topk_ids, topk_weights):
        self.experts.submit(layer, hidden, topk_ids, topk_weights)

    def wait(self, layer) -> torch.Tensor:
        return self.tp.broadcast(self.experts.wait(layer).contiguous())

    def decode_thread(self) -> AbstractContextManager:
        return self.experts.decode_thread()

    def check(self) -> None:
        self.experts.check()


class ReceivedExperts(ExpertBackend):
    """A rank other than 0: no routed expert here; each MoE layer's output comes from rank 0's broadcast."""

    def __init__(self, tp: TensorParallel):
        self.tp = tp
        self._pending: dict[int, torch.Tensor] = {}

    def set_layer(self, layer, gate_proj, up_proj, down_proj):
        raise HybridMoEError(f"tensor-parallel rank {self.tp.rank} holds no routed experts (rank 0 runs them)")

    def layers(self) -> list[int]:
        return []

    def submit(self, layer, hidden, topk_ids, topk_weights):
        self._pending[layer] = torch.empty_like(hidden, memory_format=torch.contiguous_format)

    def wait(self, layer) -> torch.Tensor:
        """Rank 0's output of layer's routed experts for this step's tokens [T, H]."""
        return self.tp.broadcast(self._pending.pop(layer))
