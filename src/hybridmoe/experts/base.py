"""Where routed experts run is decided here, not in the model.

A model's MoE block computes the router's top-k and hands (hidden, ids, weights) to an
ExpertBackend; it never sees expert weights. Backends: the torch reference (experts/torch_ref.py, any
device, the ground truth in tests), the native CPU engine (experts/factory.py NativeLayers) and the
hybrid GPU/CPU split (experts/hybrid.py); experts/factory.py builds the one a load asks for.

Every call the loader, the model runner or a model makes on a backend is declared here; the optional ones
have a default that does nothing (or the plain thing), so callers never probe for a method.

Shapes: T tokens, H hidden, K experts per token, E experts, I expert intermediate size.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext

import torch

from hybridmoe.errors import HybridMoEError


def put_expert(stacked: list[torch.Tensor], n: int, i: int, weights, device: torch.device) -> None:
    """Copy one expert's (gate, up, down) into row i of stacked [n, ...] buffers on device (made at the first)."""
    if not stacked:
        stacked.extend(torch.empty(n, *w.shape, dtype=w.dtype, device=device) for w in weights)
    for dst, w in zip(stacked, weights):
        dst[i].copy_(w)


class ExpertBackend(ABC):
    """Routed experts of every MoE layer of one model."""

    @abstractmethod
    def set_layer(self, layer: int, gate_proj: torch.Tensor, up_proj: torch.Tensor,
                  down_proj: torch.Tensor) -> None:
        """Take the stacked expert weights of one layer: gate/up [E, I, H], down [E, H, I]."""

    def set_layer_experts(self, layer: int, experts: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                          num_experts: int) -> None:
        """Take one layer's experts as (gate [I, H], up [I, H], down [H, I]) of one expert at a time, in expert order
        (how the loader reads a checkpoint). The next expert is read only once the backend is done with the
        last one, so a backend that packs as they come never holds the layer twice. Default: stacked on the
        tensors' device and in their dtype, then set_layer."""
        stacked: list[torch.Tensor] = []
        for e, weights in enumerate(experts):
            put_expert(stacked, num_experts, e, weights, weights[0].device)
        self.set_layer(layer, *stacked)

    def set_layer_biases(self, layer: int, gate_bias: torch.Tensor, up_bias: torch.Tensor,
                         down_bias: torch.Tensor) -> None:
        """Take one layer's expert biases, gate/up [E, I], down [E, H] (gpt-oss), after its weights; called only for
        a model whose config declares expert_bias. Default: the backend runs experts without biases."""
        raise HybridMoEError(f"{type(self).__name__} runs routed experts without biases")

    def takes_fp8_codes(self) -> bool:
        """Whether set_layer_experts takes a block-FP8 matrix as Fp8Codes (experts/fp8_codes.py: its codes and
        scales as the checkpoint has them) in place of a float tensor. False (default): float tensors only."""
        return False

    def takes_mxfp4_codes(self) -> bool:
        """Whether set_layer_experts takes an MXFP4 matrix as Mxfp4Codes (experts/mxfp4_codes.py: its e2m1 codes and
        e8m0 scales as the checkpoint has them) in place of a float tensor. False (default): float tensors only."""
        return False

    def int4_codes_group(self, symmetric: bool = False) -> int | None:
        """The int4 group size in which set_layer_codes takes int4 codes as they are (symmetric: codes without zero
        points, as compressed-tensors ships them; else GPTQ/AWQ's with zero points); None (default): the backend
        takes float weights only."""
        return None

    def set_layer_codes(self, layer: int, gate_proj, up_proj, down_proj) -> None:
        """Take one layer's experts as int4 codes (weights/int4_codes.py Int4Codes, stacked [E, ...]) in the group
        size int4_codes_group() gives; called only when that is not None."""
        raise HybridMoEError(f"{type(self).__name__} takes no int4 codes (its int4_codes_group() is None)")

    @abstractmethod
    def submit(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
               topk_weights: torch.Tensor) -> None:
        """Start sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t]) for layer.

        hidden [T, H], topk_ids [T, K] int, topk_weights [T, K] float32.
        """

    @abstractmethod
    def wait(self, layer: int) -> torch.Tensor:
        """The result of the last submit for layer: [T, H], hidden's dtype and device."""

    @abstractmethod
    def layers(self) -> list[int]:
        """Indices of the layers whose weights have been set."""

    def after_layer(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """The residual stream after decoder layer `layer`: what a backend that defers expert output
        (experts/deferral.py) adds there. hidden [T, H]; returned as is when nothing is due."""
        return hidden

    def forward_logits(self, layer: int, hidden: torch.Tensor, router_logits: torch.Tensor, top_k: int,
                       renormalize: bool, residual: torch.Tensor | None = None) -> torch.Tensor | None:
        """forward() of the router's softmax top-k of router_logits [T, E], for a backend that routes a
        step itself (fusing the top-k into what it does next); None: it does not, the caller routes.
        residual [T, H]: return residual + forward() (rounded as torch adds them) instead."""
        return None

    def forward(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """submit() then wait(): the layer's experts' output [T, H]."""
        self.submit(layer, hidden, topk_ids, topk_weights)
        return self.wait(layer)

    def use_fixed_shapes(self, max_tokens: int, dtype: torch.dtype) -> bool:
        """Whether steps of at most max_tokens tokens (hidden states in dtype) can run from now on in shapes fixed
        by their token count, with no host sync, so that a CUDA graph can capture them. Default False: the model
        runner then runs every step eagerly."""
        return False

    def prefetch_during(self, layer: int, modules: list) -> None:
        """Hand the backend up to three modules whose .weight the step reads right after layer's MoE block (the
        next layer's attention projections and router): a backend whose GPU waits for CPU work there may prefetch
        them into the GPU's L2 meanwhile. Models call it once, at construction. Default: nothing."""

    def decode_thread(self) -> AbstractContextManager:
        """The context a fixed-shape step is launched and waited for in, on the thread that drives the GPU (the
        hybrid split pins that thread off its CPU workers' cores). Default: nothing."""
        return nullcontext()

    def wait_step(self, done: torch.cuda.Event) -> None:
        """Wait for a fixed-shape step's event `done` (recorded after its tokens' copy). Default: synchronize."""
        done.synchronize()

    def check(self) -> None:
        """Raise what work the backend ran on the CUDA stream recorded as failed (called after a step's results
        were waited for). Default: nothing to check."""
