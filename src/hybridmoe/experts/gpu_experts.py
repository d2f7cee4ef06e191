"""The GPU share of a MoE layer: the routed experts cached on the GPU, applied to their slots.

weighted_experts is the reference (any device, any T; it groups slots by expert with one host
sync). The experts are dense tensors or, kept packed on the GPU, PackedMatrix (experts/packed_gpu.py).
fixed_shape_experts computes the same sum in shapes fixed by T, K and E with no host sync,
so a CUDA graph can capture it: on CUDA with triton and SiLU or clamped-SwiGLU experts, two grouped Triton
kernels that read only the routed experts' weights (gpu_experts_triton.py: expert-major for decode, over
the slot blocks made here for longer steps); elsewhere (the CPU in CI, no triton, another activation) its torch version.

An expert is down(act(gate x) * up x), or with a two-input GLU as act (gpt-oss's ClampedSwiGLU,
layers/clamped_swiglu.py) down(act(gate x, up x)); biases (gpt-oss), when given, are (gate_bias [E, I],
up_bias [E, I], down_bias [E, H]) of these E experts: gate and up add theirs before the activation, down its
own before the slot's routing weight multiplies the expert's output (as TorchExperts and the CPU engine do).

T tokens, K experts per token, S = T * K slots, E experts here, H hidden, I expert intermediate size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridmoe.errors import HybridMoEError
from hybridmoe.layers.clamped_swiglu import ClampedSwiGLU
from hybridmoe.platform import HAVE_TRITON

Biases = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""An expert layer's (gate_bias [E, I], up_bias [E, I], down_bias [E, H])."""


def triton_usable(device: torch.device, act) -> bool:
    """Whether fixed_shape_experts and gpu_share run the Triton kernels for this device and activation."""
    return HAVE_TRITON and device.type == "cuda" and (act is F.silu or isinstance(act, ClampedSwiGLU))


def kernel_glu(act) -> tuple[int, float, float]:
    """The Triton kernels' (GLU, alpha, limit) for an activation: 0 for SiLU, 1 with the clamped SwiGLU's gain
    and clamp."""
    if isinstance(act, ClampedSwiGLU):
        return 1, float(act.alpha), float(act.limit)
    if act is F.silu:
        return 0, 0.0, 0.0
    raise HybridMoEError(f"the Triton GPU experts compute SiLU or the clamped SwiGLU, not {act!r}")


def gated(act, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """An expert's h from its gate and up projections (biases added): act(gate, up) for a two-input GLU
    (ClampedSwiGLU), else act(gate) * up."""
    return act(gate, up) if isinstance(act, ClampedSwiGLU) else act(gate) * up


def layer_biases(biases: Biases | None, dtype: torch.dtype) -> Biases | tuple[None, None, None]:
    """biases in dtype (what F.linear adds them to), or three Nones."""
    return tuple(b.to(dtype) for b in biases) if biases is not None else (None, None, None)


def dense_weights(gate, up, down) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The experts as dense [E, N, K] tensors: a PackedMatrix (GPU experts kept packed,
    experts/packed_gpu.py) dequantized as its kernels see it, a tensor as it is. Only the torch
    paths need it (the Triton kernels read packed weights as they are)."""
    return tuple(w if isinstance(w, torch.Tensor) else w.dense() for w in (gate, up, down))


def weighted_experts(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                     ids: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor | None, act,
                     biases: Biases | None = None) -> torch.Tensor:
    """sum over slots with mask of weights * expert_ids(x), as TorchExperts computes it; float32 [T, H].

    x [T, H]; gate, up [E, I, H]; down [E, H, I]; ids [T, K] (local to these E); weights [T, K];
    mask [T, K] bool (None: every slot); biases of these E experts, or None. Slots are grouped by expert with
    one host sync (the counts), so on a GPU a long prefill does not wait on the host once per expert.
    """
    gate, up, down = dense_weights(gate, up, down)
    gate_bias, up_bias, down_bias = layer_biases(biases, gate.dtype)
    K, E = ids.shape[1], gate.shape[0]
    xw = x.to(gate.dtype)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat = ids.reshape(-1).long()
    if mask is not None:
        flat = torch.where(mask.reshape(-1), flat, E)  # masked slots sort last, into bin E
    order = torch.sort(flat, stable=True).indices  # [T * K] slots grouped by expert
    counts = torch.zeros(E + 1, dtype=torch.long, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat))[:E].tolist()  # [E], the one sync
    start = 0
    for e, n in enumerate(counts):
        if n:
            slots = order[start:start + n]
            tok = slots // K
            xe = xw[tok]
            gb, ub, db = (None, None, None) if biases is None else (gate_bias[e], up_bias[e], down_bias[e])
            ye = F.linear(gated(act, F.linear(xe, gate[e], gb), F.linear(xe, up[e], ub)), down[e], db)
            out.index_add_(0, tok, ye.float() * weights.reshape(-1)[slots].float().unsqueeze(1))
        start += n
    return out


def gpu_share(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
              ids: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor, act,
              biases: Biases | None = None) -> torch.Tensor:
    """The GPU share of a step of any length (prefill): the Triton kernels where usable (a few
    launches, no host sync), else weighted_experts. Same arguments and result as fixed_shape_experts."""
    if triton_usable(x.device, act):
        return fixed_shape_experts(x, gate, up, down, ids, weights, mask, act, biases)
    return weighted_experts(x, gate, up, down, ids, weights, mask, act, biases)


def fixed_shape_experts(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                        ids: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor, act,
                        biases: Biases | None = None) -> torch.Tensor:
    """weighted_experts' sum with shapes that depend on T, K and E only; float32 [T, H].

    x [T, H]; gate, up [E, I, H]; down [E, H, I]; ids [T, K] local to these E (anything where mask
    is False); weights [T, K]; mask [T, K] bool; biases of these E experts, or None.
    """
    if triton_usable(x.device, act):
        from hybridmoe.experts.gpu_experts_triton import triton_experts

        return triton_experts(x, gate, up, down, ids, weights, mask, act, biases)
    return torch_fixed_experts(x, gate, up, down, ids, weights, mask, act, biases)


def torch_fixed_experts(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                        ids: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor, act,
                        biases: Biases | None = None) -> torch.Tensor:
    """fixed_shape_experts in torch alone (same arguments).

    Masked-out slots compute expert 0 with weight 0. Every expert on every token reads each expert
    once, and a dense [T, E] weight matrix picks the sum; gathering each slot's expert moves about
    three times T * K experts (read, copy, read the copy), so it is used only when that is less.
    """
    gate, up, down = dense_weights(gate, up, down)
    T, K = ids.shape
    E = gate.shape[0]
    xw = x.to(gate.dtype)
    w = torch.where(mask, weights.float(), 0.0)  # [T, K]
    ids = torch.where(mask, ids.long(), 0)
    gate_bias, up_bias, down_bias = layer_biases(biases, gate.dtype)
    if 3 * T * K < E:
        xs = xw[:, None, :, None]  # [T, 1, H, 1]
        g, u = gate[ids] @ xs, up[ids] @ xs  # [T, K, I, 1]
        if biases is not None:
            g, u = g + gate_bias[ids].unsqueeze(-1), u + up_bias[ids].unsqueeze(-1)
        y = (down[ids] @ gated(act, g, u)).squeeze(-1)  # [T, K, H]
        if biases is not None:
            y = y + down_bias[ids]
        return (y.float() * w.unsqueeze(-1)).sum(dim=1)
    xt = xw.t()  # [H, T]
    g, u = gate @ xt, up @ xt  # [E, I, T]
    if biases is not None:
        g, u = g + gate_bias.unsqueeze(-1), u + up_bias.unsqueeze(-1)
    y = down @ gated(act, g, u)  # [E, H, T]
    if biases is not None:
        y = y + down_bias.unsqueeze(-1)
    dense = torch.zeros(T, E, dtype=torch.float32, device=x.device).scatter_add_(1, ids, w)  # [T, E]
    return torch.einsum("te,eht->th", dense, y.float())


def block_size(S: int, E: int) -> int:
    """Slots per block: 16 (tl.dot's least) while an expert gets a few slots (decode), up to 64
    when each gets many (prefill), so weights are read about once per 64 slots."""
    return min(64, max(16, 1 << (S // max(E, 1) - 1).bit_length()))


def slot_blocks(sid: torch.Tensor, E: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of slots grouped by expert, in fixed shapes: block_expert [NB] (-1: unused block) and
    block_slots [NB, block] (-1: padding), NB = ceil(S / block) + E.

    sid [S]: each slot's expert, E where the slot is not on this GPU.
    """
    S = sid.numel()
    order = torch.sort(sid, stable=True).indices  # [S] slots grouped by expert
    counts = torch.zeros(E + 1, dtype=torch.long, device=sid.device).scatter_add_(
        0, sid, torch.ones_like(sid))[:E]  # [E], no host sync (bincount would size its output on the host)
    padded = (counts + block - 1) // block * block
    padded_end = torch.cumsum(padded, 0)  # [E] where each expert's run of blocks ends
    sorted_start = torch.cumsum(counts, 0) - counts  # [E] where its slots start in `order`
    NB = -(-S // block) + E
    first = torch.arange(NB, device=sid.device) * block  # [NB] first padded position of each block
    expert = torch.searchsorted(padded_end, first, right=True)  # [NB], E past the last run
    used = expert < E
    e = torch.where(used, expert, 0)
    offset = first - (padded_end[e] - padded[e])  # [NB] position of the block within its expert's run
    r = offset.unsqueeze(1) + torch.arange(block, device=sid.device)  # [NB, block]
    valid = used.unsqueeze(1) & (r < counts[e].unsqueeze(1))
    slots = order[torch.where(valid, sorted_start[e].unsqueeze(1) + r, 0)]
    return torch.where(used, expert, -1).to(torch.int32), torch.where(valid, slots, -1).to(torch.int32)
