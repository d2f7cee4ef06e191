"""The AMX 2x2 tile loop of csrc/moe/amx_kernels.inc alone: ns per tile product (one TDPBF16PS or TDPBSSD,
16 cycles each at the documented peak), on one thread and on every core at once, then by thread count.

    python3 benchmarks/kernel.py amx-tile [--build-dir DIR] [--json F]

First builds benchmarks/native/amx_tile_loop.cpp (standalone, no repo code; g++ with the AMX flags), then
runs it (an AMX host only: elsewhere it says so and exits 1). Cases: step orders (all loads first / the
reordered loads of k_loop), A tiles from an L1- or L2-sized ring, B from an L1- or L2-sized ring (bf16
kernels read B in place: 64 KiB a 32-row block of 1024 K), A prefetched into L1, C round trips, and the
kernels' L2 prefetch of the next block from DRAM (prefetcht1, lines per step). Then the scaling of two cases
with the threads (1 .. every CPU, pinned to CPUs 0..n-1, and half the CPUs on the even ones): per-thread
time that grows past some count is a shared unit (SMT siblings, power). 16384 FLOP per product: TFLOP/s
per core = 16.384 / ns.
"""

from __future__ import annotations

import re

from .cli import write_json
from .native_build import add_build_arguments, build_amx_tile_loop, run_binary

CASE_ROW = re.compile(r"^(?P<case>.*?)\s+(?P<a>[\d.]+)\s+(?P<b>[\d.]+)\s+\|\|\s+(?P<c>[\d.]+)\s+(?P<d>[\d.]+)\s*$")
SCALING_CELL = re.compile(r"(even )?(\d+):\s+([\d.]+)")


def add_arguments(p):
    add_build_arguments(p, variants=False)


def parse(lines: list[str]) -> dict:
    """The binary's two tables: per case ns per product (bf16 / int8, one thread / every thread), and per
    scaling case ns by thread count ("even": that many threads on every other CPU)."""
    cases, scaling = [], []
    for line in lines:
        m = CASE_ROW.match(line)
        if m:
            cases.append({"case": m["case"].strip(), "bf16_1_thread": float(m["a"]), "int8_1_thread": float(m["b"]),
                          "bf16_all_threads": float(m["c"]), "int8_all_threads": float(m["d"])})
            continue
        cells = SCALING_CELL.findall(line)
        if cells:
            name = line[:SCALING_CELL.search(line).start()].strip()
            scaling.append({"case": name, "threads_ns": {int(n): float(v) for even, n, v in cells if not even},
                            "even_cpus_ns": {int(n): float(v) for even, n, v in cells if even}})
    return {"cases": cases, "scaling": scaling}


def run(args) -> int:
    status, lines = run_binary(build_amx_tile_loop(args.build_dir), [])
    write_json(args.json, {"status": status, **parse(lines)})
    return status
