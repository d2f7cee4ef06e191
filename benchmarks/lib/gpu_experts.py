"""The GPU share of one MoE layer: the Triton kernels against the torch fixed-shape version they
replace and the synchronous weighted_experts, in the same process, at real shapes.

Each variant runs a decode step's GPU share (T tokens, K slots, E experts cached on the GPU, a
fraction --on-gpu of the slots routed to them, the rest masked as CPU slots). Fixed-shape
variants are timed as CUDA-graph replays (as decode runs them); weighted_experts eagerly (it
syncs). Bandwidth = bytes of the distinct routed experts' weights / time: what a kernel that
reads only the routed experts must move, to set against the GPU's peak. --format int4 / int8 keeps the
experts packed as the hybrid engine does with int4 / int8 CPU experts (experts/packed_gpu.py, packed by
the native engine) and also times the bf16 kernel on the same weights dequantized ("bf16 us").
"triton us" is the kernels the step takes by default; "gemv us" and "dot us" force the slot-major GEMV kernels
(gpu_experts_gemv_triton.py) or the tl.dot ones (expert-major up to 64 slots), to compare the two.
--split-k GUxDN,... also times the GEMV kernels with K split GU ways in gate/up and DN ways in down (one
"split GUxDN us" column each; the default, gpu_experts_triton.GEMV_SPLIT_K, is "gemv us").

    python3 benchmarks/kernel.py gpu-experts --shape qwen3-30b-a3b --tokens 1,4,8 --format int4 \\
        --json out/gpu_experts.json
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from hybridmoe.experts.cpu_experts import CpuExperts
from hybridmoe.experts.expert_bytes import packed_expert_bytes
from hybridmoe.experts.gpu_experts import fixed_shape_experts, torch_fixed_experts, weighted_experts
from hybridmoe.experts.packed_gpu import pack_gpu_experts

from .cli import int_list, write_json
from .common import SHAPES, capture_graph, seconds_per_call


def add_arguments(p):
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--tokens", default="1,4,8", help="comma-separated T values")
    p.add_argument("--experts", type=int, default=64, help="E: experts cached on the GPU in the layer")
    p.add_argument("--total-experts", type=int, default=128, help="experts in the layer (ids drawn from these)")
    p.add_argument("--format", default="bf16", choices=["bf16", "int4", "int8"], help="how the experts are kept")
    p.add_argument("--group-size", type=int, default=128, choices=[32, 64, 128], help="int4 group size")
    p.add_argument("--split-k", default="", metavar="GUxDN,...",
                   help="also these splits of K (gate/up x down) in the Triton kernels, e.g. 2x1,4x2")
    p.add_argument("--reps", type=int, default=50, help="calls per timed trial")
    p.add_argument("--trials", type=int, default=5, help="timed trials (the median is reported)")


def graph_seconds(fn, reps: int, trials: int) -> float:
    """Median seconds per call of fn captured once as a CUDA graph and replayed reps times."""
    return seconds_per_call(capture_graph(fn).replay, reps, trials)


def routing(T: int, K: int, total: int, on_gpu: int, seed: int):
    """ids [T, K] distinct per token among `total` experts; the first on_gpu are the cached ones."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(total, generator=g)[:K] for _ in range(T)])
    mask = ids < on_gpu
    return torch.where(mask, ids, 0), torch.rand(T, K, generator=g), mask


def run(args) -> int:
    # Triton: imported where it runs (the GPU's kernels)
    from hybridmoe.experts.gpu_experts_triton import triton_experts

    shape = SHAPES[args.shape]
    H, I, K = shape["H"], shape["I"], shape["K"]
    dev = torch.device("cuda")
    E = args.experts
    g = torch.Generator(device=dev).manual_seed(0)
    gate, up = (torch.randn(E, I, H, device=dev, generator=g, dtype=torch.bfloat16) / 32 for _ in range(2))
    down = torch.randn(E, H, I, device=dev, generator=g, dtype=torch.bfloat16) / 32
    experts = dense = (gate, up, down)
    expert_bytes = 3 * I * H * 2
    if args.format != "bf16":
        cpu = CpuExperts(*(w.cpu() for w in dense), format=args.format, group_size=args.group_size)
        experts = pack_gpu_experts(cpu, dev, torch.bfloat16)
        dense = tuple(m.dense() for m in experts)  # the same weights, for the bf16 kernel and the references
        expert_bytes = packed_expert_bytes(args.format, H, I, args.group_size, False)
        del cpu
    splits = [tuple(int(n) for n in v.split("x")) for v in args.split_k.split(",") if v]
    rows = []
    print(f"{args.shape}: H={H} I={I} K={K}, {E} of {args.total_experts} experts on the GPU ({args.format}, "
          f"{expert_bytes / 1e6:.1f} MB each); routing uniform, so ~{E / args.total_experts:.0%} of slots are GPU slots")
    print(f"{'T':>3} {'routed':>6} {'triton us':>10} {'GB/s':>7} {'gemv us':>8} {'dot us':>8} {'bf16 us':>8} "
          f"{'torch fixed us':>15} "
          f"{'weighted us':>12} {'torch/triton':>13} {'max |diff|':>11}"
          + "".join(f" {'split %dx%d us' % sk:>14}" for sk in splits))
    for T in int_list(args.tokens):
        ids, weights, mask = routing(T, K, args.total_experts, E, seed=T)
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(dev, torch.bfloat16)
        ids, weights, mask = ids.to(dev), weights.to(dev), mask.to(dev)
        step = (ids, weights, mask, F.silu)
        routed = int(torch.unique(ids[mask]).numel())
        triton_fn = partial(fixed_shape_experts, x, *experts, *step)
        bf16_fn, torch_fn, weighted_fn = (partial(f, x, *dense, *step) for f in
                                          (fixed_shape_experts, torch_fixed_experts, weighted_experts))
        t_triton = graph_seconds(triton_fn, args.reps, args.trials)
        t_bf16 = graph_seconds(bf16_fn, args.reps, args.trials) if args.format != "bf16" else t_triton
        t_torch = graph_seconds(torch_fn, args.reps, args.trials)
        t_weighted = seconds_per_call(weighted_fn, args.reps, args.trials)
        diff = (triton_fn() - weighted_fn()).abs().max().item()
        gbs = routed * expert_bytes / t_triton / 1e9
        t_gemv, t_dot = (graph_seconds(partial(triton_experts, x, *experts, *step[:3], gemv=g), args.reps,
                                       args.trials) for g in (True, False))
        t_split = {f"{gu}x{dn}": graph_seconds(partial(triton_experts, x, *experts, *step[:3], gemv=True,
                                                       split_k=(gu, dn)), args.reps, args.trials) for gu, dn in splits}
        rows.append(dict(shape=args.shape, format=args.format, T=T, K=K, gpu_experts=E, routed_experts=routed,
                         triton_us=t_triton * 1e6, gemv_us=t_gemv * 1e6, dot_us=t_dot * 1e6, bf16_us=t_bf16 * 1e6,
                         torch_fixed_us=t_torch * 1e6,
                         weighted_us=t_weighted * 1e6, triton_gbs=gbs, max_diff=diff,
                         split_us={k: v * 1e6 for k, v in t_split.items()}))
        print(f"{T:>3} {routed:>6} {t_triton * 1e6:>10.1f} {gbs:>7.0f} {t_gemv * 1e6:>8.1f} {t_dot * 1e6:>8.1f} "
              f"{t_bf16 * 1e6:>8.1f} {t_torch * 1e6:>15.1f} "
              f"{t_weighted * 1e6:>12.1f} {t_torch / t_triton:>12.1f}x {diff:>11.2e}"
              + "".join(f" {v * 1e6:>14.1f}" for v in t_split.values()))
    write_json(args.json, rows)
    return 0
