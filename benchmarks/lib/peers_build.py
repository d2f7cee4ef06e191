"""Build llama.cpp's llama-bench and llama-quantize from .peers/llama.cpp (written by `sources`), outside the
work tree: CUDA for sm_90 (GGML_CUDA=ON, CMAKE_CUDA_ARCHITECTURES=90) and the host's own ISA (GGML_NATIVE), the
server, examples and tests off, the two targets only. Where the CUDA toolkit lacks cuBLAS or the driver's link,
they are taken from torch's CUDA wheels and the loader's cache (peers_cuda.py).

    python3 benchmarks/peers.py build [--build-dir /tmp/peers-build] [--jobs 15] [--cpu-only]

A build directory that already holds both binaries is reused as it is (a later device call on the same warm
machine skips the build); --rebuild builds again. --cpu-only leaves CUDA out (a machine without a GPU).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

from hybridmoe.errors import HybridMoEError

from .cli import write_json
from .peers_cuda import configure_hints, missing_targets
from .peers_sources import LLAMA_DIR, PROVENANCE

DEFAULT_BUILD_DIR = "/tmp/peers-build"
TARGETS = ("llama-bench", "llama-quantize")
CUDA_ARCH = "90"


def add_build_arguments(parser) -> None:
    """The options every subcommand that needs the binaries takes."""
    parser.add_argument("--build-dir", default=DEFAULT_BUILD_DIR,
                        help=f"llama.cpp's build directory (default {DEFAULT_BUILD_DIR}; reused when built)")
    parser.add_argument("--source", default=str(LLAMA_DIR), help=f"llama.cpp's sources (default {LLAMA_DIR})")
    parser.add_argument("--jobs", type=int, default=15, help="parallel compile jobs (default 15)")
    parser.add_argument("--cpu-only", action="store_true", help="build without CUDA (a machine without a GPU)")


def add_arguments(parser) -> None:
    add_build_arguments(parser)
    parser.add_argument("--rebuild", action="store_true", help="configure and build even if the binaries exist")


def binaries(build_dir: str | Path) -> dict[str, Path]:
    """Target name -> its executable in build_dir."""
    return {t: Path(build_dir) / "bin" / t for t in TARGETS}


def provenance(source: str | Path) -> dict:
    """What `sources` recorded of the sources: the sdist and llama.cpp's commit ({} when nothing)."""
    path = Path(source) / PROVENANCE
    return json.loads(path.read_text()) if path.is_file() else {}


def cmake_configure_command(source: str | Path, build_dir: str | Path, cpu_only: bool) -> list[str]:
    """The cmake configure command line; the build reports llama.cpp's own commit (the sources sit inside this
    repository, whose commit cmake would otherwise find)."""
    commit = provenance(source).get("llama_cpp_commit")
    cmd = ["cmake", "-S", str(source), "-B", str(build_dir), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
           "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
           "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_COMMON=ON", "-DLLAMA_OPENSSL=OFF",
           f"-DGGML_CUDA={'OFF' if cpu_only else 'ON'}"]
    if not cpu_only:
        cmd.append(f"-DCMAKE_CUDA_ARCHITECTURES={CUDA_ARCH}")
    if commit:  # build_number would count this repository's commits: 0, as a build outside llama.cpp's git has
        cmd += [f"-DLLAMA_BUILD_COMMIT={commit[:7]}", "-DLLAMA_BUILD_NUMBER=0"]
    if shutil.which("ninja"):
        cmd += ["-G", "Ninja"]
    return cmd


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.run(cmd, capture_output=True, text=True, errors="replace")


def _failed(cmd: list[str], done: subprocess.CompletedProcess) -> HybridMoEError:
    tail = "\n".join((done.stdout + done.stderr).splitlines()[-40:])
    return HybridMoEError(f"`{' '.join(cmd[:3])} ...` failed (exit {done.returncode}):\n{tail}")


def configure(source: str | Path, build_dir: str | Path, cpu_only: bool) -> list[str]:
    """cmake's configure; where it stops for want of cuBLAS or the driver, again with them pointed at
    (peers_cuda.py). The lines saying where they came from."""
    cmd, missing, notes = cmake_configure_command(source, build_dir, cpu_only), set(), []
    while True:
        done = _run(cmd)
        if done.returncode == 0:
            return notes
        found = missing_targets(done.stdout + done.stderr) - missing
        if cpu_only or not found:
            raise _failed(cmd, done)
        missing |= found
        hints, notes = configure_hints(missing, Path(build_dir))
        cmd = cmake_configure_command(source, build_dir, cpu_only) + hints
        print("# " + "; ".join(notes), flush=True)


def build(source: str | Path, build_dir: str | Path, jobs: int, cpu_only: bool, rebuild: bool = False) -> dict:
    """llama-bench and llama-quantize built in build_dir (or found there); their paths and the build's seconds."""
    bins = binaries(build_dir)
    if not rebuild and all(p.is_file() for p in bins.values()):
        return {"binaries": {k: str(v) for k, v in bins.items()}, "built": False, "seconds": 0.0}
    if not (Path(source) / "CMakeLists.txt").is_file():
        raise HybridMoEError(f"no llama.cpp sources in {source}: run `python3 benchmarks/peers.py sources` on a "
                             "machine with the sdist, and carry .peers/ to this one")
    start = time.perf_counter()
    notes = configure(source, build_dir, cpu_only)
    cmd = ["cmake", "--build", str(build_dir), "--target", *TARGETS, "-j", str(jobs)]
    done = _run(cmd)
    if done.returncode != 0:
        raise _failed(cmd, done)
    missing = [str(p) for p in bins.values() if not p.is_file()]
    if missing:
        raise HybridMoEError(f"the build finished without {', '.join(missing)}")
    return {"binaries": {k: str(v) for k, v in bins.items()}, "built": True, "seconds": time.perf_counter() - start,
            "notes": notes}


def run(args) -> int:
    result = build(args.source, args.build_dir, args.jobs, args.cpu_only, args.rebuild)
    state = f"built in {result['seconds']:.0f} s" if result["built"] else "already built (--rebuild to build again)"
    print(f"llama.cpp {state}: {', '.join(result['binaries'].values())}")
    write_json(args.json, result)
    return 0
