"""OffloadedExperts: a torch module that stands in for a transformers Experts module and runs its routed experts in
the native CPU expert engine (experts/cpu_experts.py CpuExperts).

Shapes: T tokens, K experts per token, H hidden.

    experts(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]

is what transformers' sparse MoE blocks call on their `experts` module once their router has chosen and weighted
each token's experts, so the router, top-k, normalization, routed scaling and shared experts stay the model's own.
The engine holds the packed weights in CPU memory and reads x in float32 or bfloat16: activations of another dtype
cross as float32, activations on a GPU cross to the CPU and the result goes back to their device and dtype.
The module holds no parameters: the model's state_dict() and parameters() no longer list the routed experts.

Autograd: the output has a grad_fn whose backward raises HybridMoEError, so inference works with grad enabled
and training fails loudly instead of silently skipping the experts' gradient; _CpuExpertsCall is where a backward
goes. The engine may be empty (transformers built the module from the model's config): hybridmoe.hf.from_pretrained
fills it with load() once the layer's experts are packed.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.cpu_experts import CpuExperts

_ENGINE_DTYPES = (torch.float32, torch.bfloat16)
"""The activation dtypes the engine reads as they are; any other crosses as float32."""


class OffloadedExperts(nn.Module):
    """One MoE layer's routed experts in the native CPU engine, called as transformers' Experts modules are."""

    def __init__(self, config=None):
        """config: the model's config, as transformers builds an Experts module (kept, not read); the module holds
        no experts until load()."""
        super().__init__()
        self.config = config
        self.cpu_experts: CpuExperts | None = None

    @classmethod
    def holding(cls, experts: CpuExperts, config=None) -> OffloadedExperts:
        module = cls(config)
        module.load(experts)
        return module

    def load(self, experts: CpuExperts) -> None:
        """The packed experts this module runs from now on."""
        if not isinstance(experts, CpuExperts):
            raise HybridMoEError(f"OffloadedExperts runs a CpuExperts, got {type(experts).__name__}")
        self.cpu_experts = experts

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """sum_k top_k_weights[t, k] * expert_{top_k_index[t, k]}(hidden_states[t]), [T, H] in hidden_states' dtype
        and device."""
        if self.cpu_experts is None:
            raise HybridMoEError("this OffloadedExperts holds no experts (hybridmoe.hf.from_pretrained loads them "
                                 "into the modules it builds; offload_experts builds them full)")
        return _CpuExpertsCall.apply(hidden_states, top_k_index, top_k_weights, self.cpu_experts)

    def extra_repr(self) -> str:
        experts = self.cpu_experts
        if experts is None:
            return "empty"
        E, H, I = experts.packed_state()["shape"]
        glu = f", {experts.glu.name}" if experts.glu is not None else ""
        biases = ", biases" if experts.has_biases else ""
        return (f"num_experts={E}, hidden={H}, intermediate={I}, format={experts.format}, "
                f"threads={experts.threads}{glu}{biases}")


class _CpuExpertsCall(torch.autograd.Function):
    """The engine's forward as one autograd node."""

    @staticmethod
    def forward(ctx, hidden_states, top_k_index, top_k_weights, experts):
        return run_on_cpu(experts, hidden_states, top_k_index, top_k_weights)

    @staticmethod
    def backward(ctx, grad_output):
        raise HybridMoEError("hybridmoe's CPU experts compute no gradient: run the model under torch.no_grad() or "
                             "torch.inference_mode(), or keep transformers' own experts for training")


def run_on_cpu(experts: CpuExperts, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' weighted sum for hidden_states [T, H], computed on the CPU, returned on hidden_states' device in
    its dtype."""
    x_dtype = hidden_states.dtype if hidden_states.dtype in _ENGINE_DTYPES else torch.float32
    x = hidden_states.detach().to("cpu", x_dtype).contiguous()
    if x.shape[0] == 0:
        return torch.zeros_like(hidden_states)
    ids = top_k_index.detach().to("cpu").contiguous()
    weights = top_k_weights.detach().to("cpu", torch.float32).contiguous()
    return experts.forward(x, ids, weights).to(hidden_states.device, hidden_states.dtype)
