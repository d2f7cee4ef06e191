"""Peak RSS while loading and packing one DeepSeek-V3-shaped MoE layer of N routed experts, against the
issue's target: peak growth <= 1.2x the packed experts + 2 GiB.

    python3 benchmarks/load.py rss --experts 256 --formats bf16,int4 [--dir /dev/shm] [--json out.json]
    python3 benchmarks/load.py rss --experts 256 --device cuda --gpu-experts 16   # the hybrid split's load
    python3 benchmarks/load.py rss --model DIR    # a one-layer checkpoint written once (write_one_layer)
    python3 benchmarks/load.py rss --source fp8 --formats fp8,int4   # a block-FP8 checkpoint (DeepSeek-V3's)

The checkpoint (bf16, or with --source fp8 its linears in block-FP8; one decoder layer, H 7168, I 2048, N experts; a 1024-token vocabulary so that
the embeddings do not blur the experts' figure) is written under --dir and deleted at the end. Each
format loads in its own process (expert_backend native, device cpu unless --device, no expert cache;
with --gpu-experts the hybrid split, "packed" then being its CPU engines' share), after a tiny
model's load ("once": what a process pays once, imports and threads, not counted in the growth).
Printed per format: packed bytes, peak RSS growth over the process's RSS before the load, the growth
net of the model's own non-expert weights, both as ratios to packed, the target, and RssAnon /
RssFile / RssShmem near the peak (sampled): anon is our copies, file/shmem the checkpoint's pages
still mapped.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path

from hybridmoe.bench.load_rss import measure_in_subprocess, write_one_layer
from hybridmoe.weights.safetensors import SafetensorsCheckpoint

from .cli import str_list, write_json

GIB = 2**30


def add_arguments(parser):
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--formats", default="bf16,int4")
    parser.add_argument("--source", default="bf16", choices=["bf16", "fp8"],
                        help="the checkpoint's weights: bf16, or block-FP8 linears as DeepSeek-V3 ships them")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dir", default="/dev/shm", help="where the checkpoint is written (and deleted)")
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--gpu-experts", type=int, default=None,
                        help="the hybrid split with this many experts on the device (packed: the CPU share)")
    parser.add_argument("--model", default=None,
                        help="measure this one-layer checkpoint (e.g. written once for several runs) instead")


def run(args) -> int:
    work = Path(tempfile.mkdtemp(prefix="load-rss-", dir=args.dir))
    rows = []
    try:
        model = Path(args.model) if args.model else work / "model"
        if args.model is None:
            model.mkdir()
            write_one_layer(model, "deepseek_v3", "deepseek-v3", args.source, n_routed_experts=args.experts,
                            vocab_size=args.vocab)
        with SafetensorsCheckpoint(model) as ckpt:
            source = sum(math.prod(ckpt.shape(n)) * ckpt.dtype(n).itemsize for n in ckpt.weight_names()
                         if ".mlp.experts." in n)
            experts = 1 + max(int(n.split(".mlp.experts.")[1].split(".")[0]) for n in ckpt.weight_names()
                              if ".mlp.experts." in n)
        warmup = work / "warmup"
        warmup.mkdir()
        write_one_layer(warmup, "deepseek_v3", "tiny", hidden_size=128, moe_intermediate_size=128)  # any group
        print(f"one MoE layer, {experts} experts: {source / GIB:.2f} GiB of experts in {model}")
        print(f"{'format':<6} {'packed GiB':>10} {'peak GiB':>9} {'net GiB':>8} {'peak/packed':>11} "
              f"{'net/packed':>10} {'target GiB':>10} {'met':>4} {'anon':>6} {'file':>6} {'shmem':>6} {'s':>6} {'once':>5}")
        for fmt in str_list(args.formats):
            r = measure_in_subprocess(model, {"device": args.device, "expert_backend": "native",
                                              "expert_format": fmt, "expert_group_size": args.group_size,
                                              "cpu_threads": args.threads, "gpu_experts_per_layer": args.gpu_experts,
                                              "cache_dir": "", "prefill_streaming": "off"}, warmup)
            packed, peak = r["packed_bytes"], r["peak_growth"]
            net = peak - r["non_expert_bytes"]
            target = 1.2 * packed + 2 * GIB
            p = r["at_peak"]
            print(f"{fmt:<6} {packed / GIB:10.2f} {peak / GIB:9.2f} {net / GIB:8.2f} {peak / packed:11.2f} "
                  f"{net / packed:10.2f} {target / GIB:10.2f} {'yes' if peak <= target else 'no':>4} "
                  f"{p['RssAnon'] / GIB:6.2f} {p['RssFile'] / GIB:6.2f} {p['RssShmem'] / GIB:6.2f} "
                  f"{r['seconds']:6.1f} {r['warmup_growth'] / GIB:5.2f}")
            rows.append({"format": fmt, "source_bytes": source, "target_bytes": target, **r})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_json(args.json, {"model": str(model), "experts": experts, "rows": rows})
    return 0
