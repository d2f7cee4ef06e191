"""The CUDA libraries llama.cpp's CUDA backend links that a minimal toolkit lacks, found where they are.

ggml-cuda links cuBLAS (CUDA::cublas) and the driver (CUDA::cuda_driver). A toolkit of nvcc and the runtime alone
(as pip's nvidia-cuda-nvcc and nvidia-cuda-runtime wheels make one) has no cuBLAS, and a machine without the
driver's development link (libcuda.so) leaves the driver unfound: cmake then stops at "links to CUDA::cublas but
the target was not found". torch's CUDA wheels install cuBLAS with its headers (the nvidia-cublas wheel:
nvidia/cu13/ or nvidia/cublas/), and the driver is libcuda.so.1 in the loader's cache; configure_hints gives the
cmake options that point the build at them (without a driver: ggml-cuda's build that does not link it,
GGML_CUDA_NO_VMM). Only cuBLAS's own headers are taken from the wheel (linked into the build directory), so the
toolkit's headers stay the ones nvcc compiles with.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

from hybridmoe.errors import HybridMoEError

_MISSING = re.compile(r"links to:\s+CUDA::(cublasLt|cublas|cuda_driver)\s+but the target was not found")


def missing_targets(cmake_output: str) -> set[str]:
    """The CUDA:: targets a failed configure could not find ("cublas", "cublasLt", "cuda_driver")."""
    return set(_MISSING.findall(cmake_output))


def pip_cublas() -> tuple[dict[str, Path], Path] | None:
    """({"cublas": lib, "cublasLt": lib}, include dir) of the cuBLAS the nvidia-cublas wheel installed, if any."""
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        for lib in sorted(Path(base).glob("*/lib")):
            found = {name: sorted(lib.glob(f"lib{name}.so.*")) for name in ("cublas", "cublasLt")}
            include = lib.parent / "include"
            if all(found.values()) and (include / "cublas_v2.h").is_file():
                return {name: paths[0] for name, paths in found.items()}, include
    return None


def driver_library() -> Path | None:
    """libcuda.so.1 as the loader's cache lists it (x86-64), None without a driver."""
    try:
        listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, errors="replace").stdout
    except OSError:
        return None
    for line in listing.splitlines():
        name, _, path = line.strip().partition(" => ")
        if name.startswith("libcuda.so.1 ") and "x86-64" in name and Path(path).is_file():
            return Path(path)
    return None


def cublas_headers(include: Path, build_dir: Path) -> Path:
    """A folder in build_dir holding links to cuBLAS's headers (cublas*.h) in include, and nothing else."""
    shim = build_dir / "cublas-include"
    shim.mkdir(parents=True, exist_ok=True)
    for header in include.glob("cublas*.h"):
        link = shim / header.name
        link.unlink(missing_ok=True)
        link.symlink_to(header)
    return shim


def configure_hints(missing: set[str], build_dir: Path) -> tuple[list[str], list[str]]:
    """cmake options that supply the missing CUDA targets, and a line for each saying where from."""
    args, notes = [], []
    if missing & {"cublas", "cublasLt"}:
        found = pip_cublas()
        if found is None:
            raise HybridMoEError("the CUDA toolkit has no cuBLAS, which llama.cpp's CUDA backend links, and no "
                                 "nvidia-cublas wheel (torch's CUDA dependency) is installed beside this Python")
        libs, include = found
        include = cublas_headers(include, build_dir)
        args += [f"-DCUDA_cublas_LIBRARY={libs['cublas']}", f"-DCUDA_cublasLt_LIBRARY={libs['cublasLt']}",
                 f"-DCMAKE_CUDA_FLAGS=-I{include}", f"-DCMAKE_CXX_FLAGS=-I{include}"]
        notes.append(f"cuBLAS from {libs['cublas'].parent} (the nvidia-cublas wheel)")
    if "cuda_driver" in missing:
        driver = driver_library()
        args.append(f"-DCUDA_cuda_driver_LIBRARY={driver}" if driver else "-DGGML_CUDA_NO_VMM=ON")
        notes.append(f"the driver {driver}" if driver else "no driver library: GGML_CUDA_NO_VMM=ON")
    return args, notes
