"""A decode step's linear layers at batch 1-4: cuBLAS (F.linear, after the Triton RMSNorm where the layer has
one) against the Triton GEMV with the norm folded in (layers/gemv_triton.py), each inside a CUDA graph.

    python3 benchmarks/kernel.py gemv [--hidden 2048] [--heads 32] [--kv-heads 4] [--head-dim 128]
        [--experts 128] [--batch 1,4] [--calls 40] [--sweep] [--json F]

Per linear layer of a Qwen3-30B-A3B-shaped decoder layer (qkv with the input norm before it, o_proj, the
router with the residual add + post-attention norm before it), both ways are captured as a graph of
--calls calls in a row, each on its own copy of the weights (more bytes than L2 holds, as in a real step,
where a layer's weights are not in L2 when it runs); a call's time is the graph's replay time / calls
(median of 20 replays, the two ways interleaved, the least of 3 rounds), so it includes each kernel's
launch and drain inside a graph. GB/s counts the weight bytes. --sweep also times other (BLOCK_N,
BLOCK_K, num_warps) at the first batch size and prints the fastest. CUDA only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .cli import int_list, write_json
from .common import capture_graph, replay_us

L2_BYTES = 64 << 20
SWEEP = [(bn, bk, 4) for bn in (2, 4, 8, 16) for bk in (256, 512)] + [(4, 1024, 4), (8, 1024, 8)]


def add_arguments(p):
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--batch", default="1,4", help="tokens per call, comma-separated (default 1,4)")
    p.add_argument("--calls", type=int, default=40, help="calls per captured graph (default 40)")
    p.add_argument("--sweep", action="store_true", help="also time other block sizes of the Triton GEMV")


def layers(args) -> list[tuple[str, int, int, str]]:
    """(name, N, K, what comes before it: "norm", "add+norm" or "")."""
    H, D = args.hidden, args.head_dim
    return [("qkv_proj", (args.heads + 2 * args.kv_heads) * D, H, "norm"),
            ("o_proj", H, args.heads * D, ""),
            ("router", args.experts, H, "add+norm")]


def graph_of(fn, calls: int) -> torch.cuda.CUDAGraph:
    """fn(i) for i < calls captured as one graph."""
    return capture_graph(lambda: [fn(i) for i in range(calls)])


def run(args) -> int:
    # Triton: imported where it runs (the GPU's kernels)
    from hybridmoe.layers.gemv_triton import default_blocks, triton_norm_gemv
    from hybridmoe.layers.norm_triton import triton_rms_norm

    batches = int_list(args.batch)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; bf16; {args.calls} calls per graph, "
          f"each on its own weights")
    print(f"{'layer':>9} {'T':>2} {'N':>6} {'K':>5} {'before':>8} | {'cuBLAS us':>9} {'GB/s':>6} | "
          f"{'GEMV us':>8} {'GB/s':>6} {'blocks':>12} | {'ratio':>6} {'max err':>8}")
    rows = []
    for name, N, K, before in layers(args):
        copies = max(4, -(-2 * L2_BYTES // (N * K * 2)))
        ws = [torch.randn(N, K, device=dev, dtype=dtype) / K ** 0.5 for _ in range(copies)]
        nw = torch.rand(K, device=dev, dtype=dtype) + 0.5
        for T in batches:
            x = torch.randn(T, K, device=dev, dtype=dtype)
            res = torch.randn(T, K, device=dev, dtype=dtype)

            def cublas(i):
                w = ws[i % copies]
                if before == "norm":
                    return F.linear(triton_rms_norm(x, nw, 1e-6)[0], w)
                if before == "add+norm":
                    return F.linear(triton_rms_norm(x, nw, 1e-6, res)[0], w)
                return F.linear(x, w)

            def gemv(i, blocks=None):
                return triton_norm_gemv(x, ws[i % copies], None, nw if before else None, 1e-6,
                                        res if before == "add+norm" else None, blocks)[0]

            err = (gemv(0).float() - cublas(0).float()).abs().max().item()
            g_ref, g_new = graph_of(cublas, args.calls), graph_of(gemv, args.calls)
            ref_us, new_us = float("inf"), float("inf")
            for _ in range(3):
                ref_us = min(ref_us, replay_us(g_ref, 20, warmup=1) / args.calls)
                new_us = min(new_us, replay_us(g_new, 20, warmup=1) / args.calls)
            best = (default_blocks(N, K), new_us)
            if args.sweep and T == batches[0]:
                for blocks in SWEEP:
                    try:
                        g = graph_of(lambda i, b=blocks: gemv(i, b), args.calls)
                    except Exception as e:  # noqa: BLE001 (a block shape Triton cannot build is skipped)
                        print(f"    {blocks}: {type(e).__name__}")
                        continue
                    us = min(replay_us(g, 20, warmup=1) / args.calls for _ in range(2))
                    if us < best[1]:
                        best = (blocks, us)
                    del g
            gb = N * K * 2 / 1e3
            print(f"{name:>9} {T:>2} {N:>6} {K:>5} {before or '-':>8} | {ref_us:9.2f} {gb / ref_us:6.0f} | "
                  f"{new_us:8.2f} {gb / new_us:6.0f} {str(default_blocks(N, K)):>12} | {ref_us / new_us:6.2f} "
                  f"{err:8.4f}" + (f"  best {best[0]}: {best[1]:.2f} us ({ref_us / best[1]:.2f}x)"
                                   if args.sweep and T == batches[0] else ""),
                  flush=True)
            rows.append({"layer": name, "T": T, "N": N, "K": K, "before": before, "cublas_us": ref_us,
                         "gemv_us": new_us, "max_err": err, "best_blocks": best[0], "best_us": best[1]})
            del g_ref, g_new
    write_json(args.json, rows)
    return 0
