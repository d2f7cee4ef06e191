from pathlib import Path

import pytest

from benchmarks.lib import peers_cuda
from benchmarks.lib.peers_cuda import configure_hints, missing_targets
from hybridmoe.errors import HybridMoEError

# cmake -S .peers/llama.cpp ... -DGGML_CUDA=ON with a toolkit of nvcc and the runtime only
CMAKE_ERROR = """
CMake Error at ggml/src/ggml-cuda/CMakeLists.txt:178 (target_link_libraries):
  Target "ggml-cuda" links to:

    CUDA::cublas

  but the target was not found.  Possible reasons include:

    * There is a typo in the target name.
"""


def test_the_cuda_targets_a_configure_could_not_find_are_read_off_its_output():
    assert missing_targets(CMAKE_ERROR) == {"cublas"}
    assert missing_targets(CMAKE_ERROR.replace("CUDA::cublas", "CUDA::cuda_driver")) == {"cuda_driver"}
    assert missing_targets("CMake Error: CMAKE_CUDA_COMPILER not found") == set()


def test_cublas_comes_from_the_nvidia_wheel_beside_this_python(tmp_path, monkeypatch):
    lib, include = tmp_path / "cu13" / "lib", tmp_path / "cu13" / "include"
    lib.mkdir(parents=True)
    include.mkdir()
    for name in ("libcublas.so.13", "libcublasLt.so.13", "cublas_v2.h"):
        (include if name.endswith(".h") else lib).joinpath(name).write_bytes(b"")
    monkeypatch.setattr(peers_cuda, "pip_cublas", lambda: ({"cublas": lib / "libcublas.so.13",
                                                            "cublasLt": lib / "libcublasLt.so.13"}, include))
    monkeypatch.setattr(peers_cuda, "driver_library", lambda: Path("/usr/lib/x86_64-linux-gnu/libcuda.so.1"))
    (include / "cuda_runtime.h").write_bytes(b"")  # the toolkit's own: not taken from the wheel
    args, notes = configure_hints({"cublas", "cuda_driver"}, tmp_path / "build")
    shim = tmp_path / "build" / "cublas-include"
    assert f"-DCUDA_cublas_LIBRARY={lib / 'libcublas.so.13'}" in args and f"-DCMAKE_CUDA_FLAGS=-I{shim}" in args
    assert [p.name for p in shim.iterdir()] == ["cublas_v2.h"] and (shim / "cublas_v2.h").resolve().parent == include
    assert "-DCUDA_cuda_driver_LIBRARY=/usr/lib/x86_64-linux-gnu/libcuda.so.1" in args and len(notes) == 2


def test_no_driver_builds_without_linking_it_and_no_cublas_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(peers_cuda, "driver_library", lambda: None)
    assert configure_hints({"cuda_driver"}, tmp_path)[0] == ["-DGGML_CUDA_NO_VMM=ON"]
    monkeypatch.setattr(peers_cuda, "pip_cublas", lambda: None)
    with pytest.raises(HybridMoEError, match="no cuBLAS"):
        configure_hints({"cublas"}, tmp_path)
