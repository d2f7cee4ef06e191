"""The decode kernels alone (Kernels::gemm of the ISA path, few tokens): GB/s of packed weight bytes per
core, hot (in L2: what a core computes) and cold (streamed from DRAM, every core at once), per kernel build.

    python3 benchmarks/kernel.py kernel-rate [--kernel-variant NAME=KERNEL_FILE[@FLAGS] ...] [--threads 1,16]
        [--isa avx512] [--tokens 1,4] [--formats int4,int8,bf16] [--shapes deepseek-v3,qwen3-30b-a3b]
        [--modes hot,cold] [--l1 4096] [--l2 16384] [--cold-mib 256] [--hot-kib 384] [--item-blocks 8]
        [--reps 3] [--variants base,NAME] [--build-dir DIR] [--json F]

First builds benchmarks/native/decode_kernel_rate.cpp against the repo's kernel files with the extension's
compile commands (native_build.py: the timed code is the shipped code), then runs it. Per row (shape,
matrix, format, T, mode, threads, the view's software prefetch distances, kernel build): the median, least
and largest GB/s of one core, and their sum over the threads.
  hot   the same few blocks (--hot-kib) again and again: they stay in L2, so the rate is what the kernel
        computes per second, the ceiling of each core whatever the memory does;
  cold  item after item (--item-blocks blocks, as the engine cuts them) through --cold-mib per core, much
        larger than the LLC, every core at once: the memory-bound rate.
A shape computes fast enough for decode at >= 90% of the host's read bandwidth B over n cores only where
hot >= 0.9 * B / n per core. With --isa avx512 every kernel build the binary holds (the shipped one and
each --kernel-variant) is a row; --variants picks among them.
"""

from __future__ import annotations

from .native_build import add_build_arguments, run_decode_benchmark

OPTIONS = ("threads", "isa", "tokens", "formats", "shapes", "modes", "l1", "l2", "cold_mib", "hot_kib",
           "item_blocks", "reps", "variants")
COLUMNS = ["shape", "mat", "fmt", "T", "mode", "thr", "l1", "l2", "kernels", "median_gbps", "min_gbps", "max_gbps",
           "sum_gbps"]


def add_arguments(p):
    add_build_arguments(p)
    p.add_argument("--threads", default="1", help="comma list (default 1)")
    p.add_argument("--isa", default="avx512")
    p.add_argument("--tokens", default="1,4")
    p.add_argument("--formats", default="int4,int8,bf16")
    p.add_argument("--shapes", default="deepseek-v3,qwen3-30b-a3b")
    p.add_argument("--modes", default="hot,cold")
    p.add_argument("--l1", default="4096", help="comma list: bytes the kernels prefetch ahead into L1")
    p.add_argument("--l2", default="16384", help="comma list: bytes the kernels prefetch ahead into L2")
    p.add_argument("--cold-mib", type=int, default=256)
    p.add_argument("--hot-kib", type=int, default=384)
    p.add_argument("--item-blocks", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--variants", default=None, help="comma list of kernel builds to run (default: every one)")


def run(args) -> int:
    return run_decode_benchmark("decode_kernel_rate", args, OPTIONS, COLUMNS)
