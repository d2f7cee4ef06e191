"""Builds and runs the C++ micro-benchmarks of benchmarks/native/ (the kernel-rate, engine-loop and
amx-tile subcommands of benchmarks/kernel.py).

decode_kernel_rate and decode_engine_loop are each built against the repo's engine sources, each file with
the compile command the extension's build gives it, so that the timed code is the shipped code. The
commands come from CMake itself (a configure-only run of CMakeLists.txt, Release as pyproject.toml's
cmake.build-type, exporting compile_commands.json: nanobind's -Os, -fPIC, each kernel file's ISA flags
and the AMX file's -O3 included), never a copy kept here. The benchmarks' own files take moe_layer.cpp's
command (the module's baseline flags). Each kernel variant (NAME=KERNEL_FILE[@EXTRA_FLAGS], e.g. a patched
copy of moe_kernel_avx512.cpp, or the same file with other flags appended) is built with
moe_kernel_avx512.cpp's command beside the shipped kernels ("base") into the same binaries, which run
every build side by side (native/kernel_variants.h), without building the extension again.
amx_tile_loop is standalone (no repo code).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hybridmoe.errors import HybridMoEError

from .cli import write_json

ROOT = Path(__file__).resolve().parents[2]
NATIVE = ROOT / "benchmarks" / "native"
DEFAULT_BUILD_DIR = ROOT / "build" / "benchmarks"
ENGINE_FILES = ("csrc/moe/moe_kernel_amx_emulated.cpp", "csrc/moe/moe_kernel_amx.cpp", "csrc/moe/moe_kernel_avx2.cpp",
                "csrc/moe/moe_kernel_generic.cpp", "csrc/moe/moe_layer.cpp", "csrc/moe/pack.cpp",
                "csrc/runtime/thread_pool.cpp", "csrc/runtime/cpu_features.cpp", "csrc/runtime/read_bandwidth.cpp")
AMX_FLAGS = ["-O2", "-std=c++17", "-mamx-tile", "-mamx-bf16", "-mamx-int8", "-mavx512f"]


def add_build_arguments(p, variants: bool = True) -> None:
    p.add_argument("--build-dir", default=str(DEFAULT_BUILD_DIR),
                   help=f"where the binaries are built (default {DEFAULT_BUILD_DIR.relative_to(ROOT)})")
    if variants:
        p.add_argument("--kernel-variant", action="append", default=[], metavar="NAME=KERNEL_FILE[@EXTRA_FLAGS]",
                       help="also this build of the AVX-512 kernels, a row beside 'base' (repeat for several)")


def _compile_commands(path: Path) -> dict[str, list[str]]:
    """source (real path) -> its compile command, without the output, the source and the dependency-file options."""
    out = {}
    for entry in json.loads(path.read_text()):
        args = entry.get("arguments") or shlex.split(entry["command"])
        kept, skip = [], False
        for a in args:
            if skip:
                skip = False
            elif a in ("-o", "-c", "-MT", "-MF"):
                skip = True
            elif a not in ("-MD", "-MMD"):
                kept.append(a)
        out[os.path.realpath(entry["file"])] = kept
    return out


def _check(cmd: list[str]) -> None:
    if subprocess.run(cmd, cwd=ROOT).returncode != 0:
        raise HybridMoEError(f"building a native benchmark failed (output above): {shlex.join(cmd)}")


def build_decode_benchmark(name: str, out: str | Path, variants: list[str]) -> Path:
    """native/NAME.cpp (decode_kernel_rate or decode_engine_loop) built into `out` with the kernel builds
    `variants` (NAME=KERNEL_FILE[@EXTRA_FLAGS]) beside the shipped one; returns the binary."""
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.o"):
        stale.unlink()
    configure = ["cmake", "-S", str(ROOT), "-B", str(out / "cmake"), "-DCMAKE_BUILD_TYPE=Release",
                 "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON", f"-DPython_EXECUTABLE={sys.executable}"]
    if subprocess.run(configure, stdout=subprocess.DEVNULL).returncode != 0:
        raise HybridMoEError(f"configuring the native build failed: {shlex.join(configure)}")
    commands = _compile_commands(out / "cmake" / "compile_commands.json")

    def command(source: str) -> list[str]:
        found = commands.get(str((ROOT / source).resolve()))
        if found is None:
            raise HybridMoEError(f"CMakeLists.txt does not build {source}")
        return list(found)

    k512, bench = command("csrc/moe/moe_kernel_avx512.cpp"), command("csrc/moe/moe_layer.cpp") + [f"-I{NATIVE}"]
    names, jobs = ["base"], [k512 + ["-Dkernels_avx512=kernels_avx512_base", "-c", "csrc/moe/moe_kernel_avx512.cpp",
                                      "-o", str(out / "k512_base.o")]]
    for spec in variants:
        variant, _, rest = spec.partition("=")
        source, _, flags = rest.partition("@")
        if not variant or not source:
            raise HybridMoEError(f"--kernel-variant takes NAME=KERNEL_FILE[@EXTRA_FLAGS], got {spec!r}")
        names.append(variant)
        jobs.append(k512 + flags.split() + [f"-Dkernels_avx512=kernels_avx512_{variant}", "-c", source,
                                            "-o", str(out / f"k512_{variant}.o")])
    jobs += [command(f) + ["-c", f, "-o", str(out / f"{Path(f).stem}.o")] for f in ENGINE_FILES]
    jobs.append(bench + ["-c", str(NATIVE / "kernel_variants.cpp"), "-o", str(out / "kernel_variants.o")])
    listing = out / "kernel_variant_list.cpp"
    listing.write_text("\n".join(['#include "kernel_variants.h"', "namespace hmoe {",
                                  *(f"const Kernels& kernels_avx512_{n}();" for n in names),
                                  "const std::vector<KernelVariant>& kernel_variants() {",
                                  "  static const std::vector<KernelVariant> v{",
                                  *(f'    {{"{n}", kernels_avx512_{n}}},' for n in names),
                                  "  };", "  return v;", "}", "}  // namespace hmoe", ""]))
    jobs.append(bench + ["-c", str(listing), "-o", str(out / "kernel_variant_list.o")])
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        list(pool.map(_check, jobs))
    _check(bench + ["-o", str(out / name), str(NATIVE / f"{name}.cpp"), *sorted(map(str, out.glob("*.o"))),
                    "-lpthread"])
    return out / name


def build_amx_tile_loop(out: str | Path) -> Path:
    """The standalone AMX tile loop built into `out`; returns the binary."""
    binary = Path(out).resolve() / "amx_tile_loop"
    binary.parent.mkdir(parents=True, exist_ok=True)
    _check(["g++", *AMX_FLAGS, "-o", str(binary), str(NATIVE / "amx_tile_loop.cpp"), "-lpthread"])
    return binary


def run_binary(binary: str | Path, argv: list[str]) -> tuple[int, list[str]]:
    """Run the binary, its output printed as it comes; (exit status, its stdout lines)."""
    proc = subprocess.Popen([str(binary), *argv], stdout=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        lines.append(line.rstrip("\n"))
    return proc.wait(), lines


def run_decode_benchmark(name: str, args, options: tuple[str, ...], columns: list[str]) -> int:
    """native/NAME.cpp built (with args.kernel_variant) and run with the options of args it takes; its table's
    rows (columns) and "#" lines into args.json; its exit status."""
    binary = build_decode_benchmark(name, args.build_dir, args.kernel_variant)
    status, lines = run_binary(binary, option_argv(args, list(options)))
    rows, notes = table_rows(lines, columns)
    write_json(args.json, {"kernel_variants": ["base", *args.kernel_variant], "notes": notes, "rows": rows})
    return status


def _number(cell: str):
    text = cell.rstrip("%")
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return cell


def table_rows(lines: list[str], columns: list[str]) -> tuple[list[dict], list[str]]:
    """The rows of a whitespace table the binary printed (len(columns) cells, "|" ignored, its head line left
    out) as dicts, numbers parsed ("95%" -> 95); and its "#" lines."""
    rows, notes = [], []
    for line in lines:
        if line.startswith("#"):
            notes.append(line.lstrip("# "))
            continue
        cells = [c for c in line.split() if c != "|"]
        if len(cells) == len(columns) and cells[0] != columns[0]:
            rows.append({name: _number(c) for name, c in zip(columns, cells)})
    return rows, notes


def option_argv(args, names: list[str]) -> list[str]:
    """--name value for each of the binary's options (argparse's dest names) that is set."""
    argv = []
    for name in names:
        value = getattr(args, name)
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv

