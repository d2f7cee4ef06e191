"""Peak RSS while loading and packing one DeepSeek-V3-shaped MoE layer of N routed experts, against the
issue's target: peak growth <= 1.2x the packed experts + 2 GiB.

    python benchmarks/load_rss.py --experts 256 --formats bf16,int4 [--dir /dev/shm] [--json out.json]

The checkpoint (bf16, one decoder layer, H 7168, I 2048, N experts; a 1024-token vocabulary so that
the embeddings do not blur the experts' figure) is written under --dir and deleted at the end. Each
format loads in its own process (expert_backend native, device cpu, no expert cache). Printed per
format: packed bytes, peak RSS growth over the process's RSS before the load, the growth net of the
model's own non-expert weights, both as ratios to packed, the target, and RssAnon / RssFile / RssShmem
near the peak (sampled): anon is our copies, file/shmem the checkpoint's pages still mapped.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

from hybridmoe.checkpoint.presets import model_config
from hybridmoe.checkpoint.safetensors_writer import write_random_safetensors
from hybridmoe.checkpoint.tensors import tensor_specs
from hybridmoe.weights.load_rss import measure_in_subprocess

GIB = 2**30


def write_layer(out: Path, experts: int, vocab: int) -> int:
    """One DeepSeek-V3 MoE layer with `experts` routed experts in out; returns the routed experts' bytes."""
    config = model_config("deepseek_v3", "deepseek-v3", layers=1)
    config.update(n_routed_experts=experts, vocab_size=vocab, bos_token_id=0, eos_token_id=1)
    specs = tensor_specs(config)
    write_random_safetensors(out, specs, seed=0, progress=False)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return sum(s.nbytes for s in specs if ".mlp.experts." in s.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--formats", default="bf16,int4")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dir", default="/dev/shm", help="where the checkpoint is written (and deleted)")
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="load-rss-", dir=args.dir))
    rows = []
    try:
        source = write_layer(out, args.experts, args.vocab)
        print(f"DeepSeek-V3 layer, {args.experts} experts: {source / GIB:.2f} GiB of bf16 experts in {out}")
        print(f"{'format':<6} {'packed GiB':>10} {'peak GiB':>9} {'net GiB':>8} {'peak/packed':>11} "
              f"{'net/packed':>10} {'target GiB':>10} {'met':>4} {'anon':>6} {'file':>6} {'shmem':>6} {'s':>6}")
        for fmt in args.formats.split(","):
            r = measure_in_subprocess(out, {"device": "cpu", "expert_backend": "native", "expert_format": fmt,
                                            "expert_group_size": args.group_size, "cpu_threads": args.threads,
                                            "cache_dir": ""})
            packed, peak = r["packed_bytes"], r["peak_growth"]
            net = peak - r["non_expert_bytes"]
            target = 1.2 * packed + 2 * GIB
            p = r["at_peak"]
            print(f"{fmt:<6} {packed / GIB:10.2f} {peak / GIB:9.2f} {net / GIB:8.2f} {peak / packed:11.2f} "
                  f"{net / packed:10.2f} {target / GIB:10.2f} {'yes' if peak <= target else 'no':>4} "
                  f"{p['RssAnon'] / GIB:6.2f} {p['RssFile'] / GIB:6.2f} {p['RssShmem'] / GIB:6.2f} "
                  f"{r['seconds']:6.1f}")
            rows.append({"format": fmt, "source_bytes": source, "target_bytes": target, **r})
    finally:
        shutil.rmtree(out, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"experts": args.experts, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
