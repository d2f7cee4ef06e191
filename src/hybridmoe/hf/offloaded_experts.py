"""OffloadedExperts: a torch module that stands in for a transformers Experts module and runs its routed experts in
the native CPU expert engine (experts/cpu_experts.py CpuExperts).

Shapes: T tokens, K experts per token, H hidden.

    experts(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]

is what transformers' sparse MoE blocks call on their `experts` module once their router has chosen and weighted
each token's experts, so the router, top-k, normalization, routed scaling and shared experts stay the model's own.
The engine holds the packed weights in CPU memory and reads x in float32 or bfloat16: activations of another dtype
cross as float32, activations on a GPU cross to the CPU and the result goes back to their device and dtype.
The module holds no parameters: the model's state_dict() and parameters() no longer list the routed experts.

Autograd: the call is one node (_CpuExpertsCall) whose backward runs the engine's (CpuExperts.backward): the
experts are frozen, so it gives the gradients of hidden_states (to the attention and everything before) and of
top_k_weights (to the router), and no weight gradient. Recomputation is built in: the node saves only its inputs as
the engine reads them (x on the CPU in float32 or bf16, hidden_states itself where it already is so; the ids; the
routing weights in float32: T * (H + 2K) values a layer), never the experts' activations, which the backward
recomputes from x with the forward's kernels; so no expert activation is held between forward and backward, with or
without the model's gradient checkpointing. Under torch.no_grad() or inference_mode() no node is recorded, so
nothing stays saved.

The engine may be empty (transformers built the module from the model's config): hybridmoe.hf.from_pretrained
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
    """The engine's forward and backward as one autograd node; saves the inputs' CPU copies only (module docstring)."""

    @staticmethod
    def forward(ctx, hidden_states, top_k_index, top_k_weights, experts):
        x, ids, weights = cpu_inputs(hidden_states, top_k_index, top_k_weights)
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[2]:
            ctx.save_for_backward(x, ids, weights)
            ctx.experts = experts
            ctx.x_place = (hidden_states.device, hidden_states.dtype)
            ctx.weights_place = (top_k_weights.device, top_k_weights.dtype)
        if x.shape[0] == 0:
            return torch.zeros_like(hidden_states)
        return experts.forward(x, ids, weights).to(hidden_states.device, hidden_states.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        x, ids, weights = ctx.saved_tensors
        if x.shape[0] == 0:
            grad_x, grad_weights = torch.zeros_like(x), torch.zeros_like(weights)
        else:
            grad_out = grad_output.to("cpu", x.dtype).contiguous()
            grad_x, grad_weights = ctx.experts.backward(x, ids, weights, grad_out)
        return (grad_x.to(*ctx.x_place) if ctx.needs_input_grad[0] else None, None,
                grad_weights.to(*ctx.weights_place) if ctx.needs_input_grad[2] else None, None)


def cpu_inputs(hidden_states: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The engine's inputs: x [T, H] on the CPU in float32 or bfloat16 (hidden_states' dtype where the engine reads
    it, else float32), the expert ids, the routing weights in float32; contiguous and detached."""
    x_dtype = hidden_states.dtype if hidden_states.dtype in _ENGINE_DTYPES else torch.float32
    x = hidden_states.detach().to("cpu", x_dtype).contiguous()
    ids = top_k_index.detach().to("cpu").contiguous()
    weights = top_k_weights.detach().to("cpu", torch.float32).contiguous()
    return x, ids, weights
