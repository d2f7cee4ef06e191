"""The GPU share of a MoE layer in fixed shapes (no host sync, so a CUDA graph can capture it).

On CUDA with triton and SiLU experts, two grouped Triton kernels read only the routed experts'
weights (gpu_experts_triton.py). Elsewhere (the CPU in CI, no triton, another activation) the
torch version below computes the same sum.

T tokens, K experts per token, E experts here, H hidden, I expert intermediate size.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def triton_usable(device: torch.device, act) -> bool:
    """Whether fixed_shape_experts runs the Triton kernels for this device and activation."""
    return HAVE_TRITON and device.type == "cuda" and act is F.silu


def fixed_shape_experts(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                        ids: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor, act) -> torch.Tensor:
    """weighted_experts' sum with shapes that depend on T, K and E only; float32 [T, H].

    x [T, H]; gate, up [E, I, H]; down [E, H, I]; ids [T, K] local to these E (anything where mask
    is False); weights [T, K]; mask [T, K] bool.
    """
    if triton_usable(x.device, act):
        from hybridmoe.experts.gpu_experts_triton import triton_silu_experts

        return triton_silu_experts(x, gate, up, down, ids, weights, mask)
    return torch_fixed_experts(x, gate, up, down, ids, weights, mask, act)


def torch_fixed_experts(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                        ids: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor, act) -> torch.Tensor:
    """fixed_shape_experts in torch alone (same arguments).

    Masked-out slots compute expert 0 with weight 0. Every expert on every token reads each expert
    once, and a dense [T, E] weight matrix picks the sum; gathering each slot's expert moves about
    three times T * K experts (read, copy, read the copy), so it is used only when that is less.
    """
    T, K = ids.shape
    E = gate.shape[0]
    xw = x.to(gate.dtype)
    w = torch.where(mask, weights.float(), 0.0)  # [T, K]
    ids = torch.where(mask, ids.long(), 0)
    if 3 * T * K < E:
        xs = xw[:, None, :, None]  # [T, 1, H, 1]
        h = act(gate[ids] @ xs) * (up[ids] @ xs)  # [T, K, I, 1]
        y = (down[ids] @ h).squeeze(-1)  # [T, K, H]
        return (y.float() * w.unsqueeze(-1)).sum(dim=1)
    xt = xw.t()  # [H, T]
    h = act(gate @ xt) * (up @ xt)  # [E, I, T]
    y = down @ h  # [E, H, T]
    dense = torch.zeros(T, E, dtype=torch.float32, device=x.device).scatter_add_(1, ids, w)  # [T, E]
    return torch.einsum("te,eht->th", dense, y.float())
