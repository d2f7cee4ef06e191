"""`kernel.py moe-layer --gap-us`'s decode loop in C++: layers of packed experts called in turn, a gap of busy
work between calls, ms per call and GB/s beside the host read probe, the engine's own time (no Python),
per kernel build and runtime knob.

    python3 benchmarks/kernel.py engine-loop [--kernel-variant NAME=KERNEL_FILE[@FLAGS] ...]
        [--shape deepseek-v3] [--formats int4,bf16] [--tokens 1,4] [--threads 15] [--experts 32] [--layers 3]
        [--gap-us 100] [--calls 120] [--rounds 2] [--variants base,NAME] [--l2 16384,32768] [--l1 4096]
        [--item-blocks 0] [--item-prefetch 4096] [--probe 1] [--build-dir DIR] [--json F]

First builds benchmarks/native/decode_engine_loop.cpp against the repo's engine files with the extension's
compile commands (native_build.py), then runs it. Every kernel build the binary holds (the shipped kernels
and each --kernel-variant) and every combination of the runtime knobs (--l1/--l2 prefetch distances,
--item-blocks, --item-prefetch) is a row, interleaved round by round over the same packed weights (each
build's layers adopt the same buffers). Each layer's experts are copies of one packed random expert (the
kernels' time does not depend on the values); every call routes each token to K distinct random experts,
16 routings cycled. Per row: median and p90 ms per call, median GB/s, and its share of the plain probe
(%bw) and of the probe with the kernels' prefetches (%pf); --probe 0 skips the probes.
"""

from __future__ import annotations

from .native_build import add_build_arguments, run_decode_benchmark

OPTIONS = ("shape", "formats", "tokens", "threads", "experts", "layers", "calls", "rounds", "probe", "gap_us", "l1",
           "l2", "item_blocks", "item_prefetch", "variants")
COLUMNS = ["fmt", "T", "kernels", "l1", "l2", "ib", "ipf", "round", "ms", "p90_ms", "gbps", "bw_pct", "pf_pct"]


def add_arguments(p):
    add_build_arguments(p)
    p.add_argument("--shape", default="deepseek-v3")
    p.add_argument("--formats", default="int4,int8,bf16")
    p.add_argument("--tokens", default="1,4")
    p.add_argument("--threads", type=int, default=None, help="default: every CPU but one")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--calls", type=int, default=120)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--probe", type=int, default=1, help="1: probe the host read bandwidth, 0: not (nan)")
    p.add_argument("--gap-us", type=float, default=100.0)
    p.add_argument("--l1", default="4096")
    p.add_argument("--l2", default="16384")
    p.add_argument("--item-blocks", default="0")
    p.add_argument("--item-prefetch", default="4096")
    p.add_argument("--variants", default=None, help="comma list of kernel builds to run (default: every one)")


def run(args) -> int:
    return run_decode_benchmark("decode_engine_loop", args, OPTIONS, COLUMNS)
