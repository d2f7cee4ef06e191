import io
import json
import tarfile
import zipfile

import pytest

from benchmarks.lib.peers_sources import (
    PROVENANCE,
    extract_kt,
    extract_llama,
    kt_member,
    llama_member,
    prune_subdirectories,
)
from hybridmoe.errors import HybridMoEError

TOP = "llama_cpp_python-0.3.36/"


@pytest.mark.parametrize(("name", "kept"), [
    (TOP + "vendor/llama.cpp/CMakeLists.txt", "CMakeLists.txt"),
    (TOP + "vendor/llama.cpp/src/llama.cpp", "src/llama.cpp"),
    (TOP + "vendor/llama.cpp/ggml/src/ggml.c", "ggml/src/ggml.c"),
    (TOP + "vendor/llama.cpp/ggml/src/ggml-cpu/ops.cpp", "ggml/src/ggml-cpu/ops.cpp"),
    (TOP + "vendor/llama.cpp/ggml/src/ggml-cuda/mmq.cu", "ggml/src/ggml-cuda/mmq.cu"),
    (TOP + "vendor/llama.cpp/tools/llama-bench/llama-bench.cpp", "tools/llama-bench/llama-bench.cpp"),
    (TOP + "vendor/llama.cpp/tools/quantize/quantize.cpp", "tools/quantize/quantize.cpp"),
    (TOP + "vendor/llama.cpp/vendor/nlohmann/json.hpp", "vendor/nlohmann/json.hpp"),
    (TOP + "vendor/llama.cpp/ggml/src/ggml-metal/ggml-metal.m", None),
    (TOP + "vendor/llama.cpp/ggml/src/ggml-vulkan/CMakeLists.txt", None),
    (TOP + "vendor/llama.cpp/tools/server/server.cpp", None),
    (TOP + "vendor/llama.cpp/vendor/miniaudio/miniaudio.h", None),
    (TOP + "vendor/llama.cpp/models/ggml-vocab-qwen2.gguf", None),
    (TOP + "llama_cpp/llama.py", None),
])
def test_llama_cpp_keeps_the_build_sources_of_the_cpu_and_cuda_backends_and_two_tools(name, kept):
    assert llama_member(name) == kept


@pytest.mark.parametrize(("name", "kept"), [
    ("kt_kernel/__init__.py", True), ("kt_kernel/_cpu_detect.py", True), ("kt_kernel/utils/amx.py", True),
    ("kt_kernel/_kt_kernel_ext_amx.cpython-312-x86_64-linux-gnu.so", True),
    ("kt_kernel/_kt_kernel_ext_avx512_bf16.cpython-312-x86_64-linux-gnu.so", True),
    ("kt_kernel/_kt_kernel_ext_avx2.cpython-312-x86_64-linux-gnu.so", False),
    ("kt_kernel/_kt_kernel_ext_avx512_vnni.cpython-312-x86_64-linux-gnu.so", False),
    ("kt_kernel.libs/libhwloc-2efe6e32.so.15.5.2", True), ("kt_kernel-0.7.2.dist-info/METADATA", True),
    ("kt_kernel/cli/commands/model.py", False), ("deep_gemm/include/cute/arch/mma_sm90.hpp", False),
    ("sgl_kernel_kt_payload_core/payload.part", False), ("lib/mscclpp.so", False),
])
def test_kt_kernel_keeps_its_amx_and_avx512_bf16_extensions_and_their_loader(name, kept):
    assert kt_member(name) is kept


def test_cmakelists_lose_the_subdirectories_left_out():
    text = "if (X)\n    add_subdirectory(llama-bench)\n    add_subdirectory(server)\nendif()\nadd_subdirectory( mtmd )"
    assert prune_subdirectories(text, {"llama-bench"}) == "if (X)\n    add_subdirectory(llama-bench)\nendif()"


def _tar(path, files: dict[str, bytes]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(TOP + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_extract_llama_writes_the_kept_files_the_pruned_cmakelists_and_the_commit(tmp_path):
    sdist = tmp_path / "sdist.tar.gz"
    _tar(sdist, {".git/modules/vendor/llama.cpp/HEAD": b"0c1e57098bba43ac29e6e3b677cdceebdd22334f\n",
                 "vendor/llama.cpp/CMakeLists.txt": b"project(llama.cpp)\n",
                 "vendor/llama.cpp/tools/CMakeLists.txt":
                     b"add_subdirectory(llama-bench)\nadd_subdirectory(server)\n",
                 "vendor/llama.cpp/tools/llama-bench/main.cpp": b"int main() {}\n",
                 "vendor/llama.cpp/tools/server/server.cpp": b"int main() {}\n",
                 "vendor/llama.cpp/vendor/CMakeLists.txt": b"add_subdirectory(nlohmann)\nadd_subdirectory(stb)\n",
                 "vendor/llama.cpp/vendor/nlohmann/json.hpp": b"\n"})
    out = tmp_path / "llama.cpp"
    extract_llama(sdist, out)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == [
        "CMakeLists.txt", PROVENANCE, "tools/CMakeLists.txt", "tools/llama-bench/main.cpp", "vendor/CMakeLists.txt",
        "vendor/nlohmann/json.hpp"]
    assert (out / "tools/CMakeLists.txt").read_text() == "add_subdirectory(llama-bench)\n"
    assert (out / "vendor/CMakeLists.txt").read_text() == "add_subdirectory(nlohmann)\n"
    provenance = json.loads((out / PROVENANCE).read_text())
    assert provenance == {"sdist": "sdist.tar.gz", "llama_cpp_commit": "0c1e57098bba43ac29e6e3b677cdceebdd22334f"}


def test_a_tarball_without_llama_cpp_and_a_wheel_without_both_extensions_are_errors(tmp_path):
    _tar(tmp_path / "other.tar.gz", {"setup.py": b"\n"})
    with pytest.raises(HybridMoEError, match="llama-cpp-python's sdist"):
        extract_llama(tmp_path / "other.tar.gz", tmp_path / "llama.cpp")
    with zipfile.ZipFile(tmp_path / "kt.whl", "w") as z:
        z.writestr("kt_kernel/__init__.py", "")
        z.writestr("kt_kernel/_kt_kernel_ext_amx.cpython-312-x86_64-linux-gnu.so", b"")
    with pytest.raises(HybridMoEError, match="expected one per variant"):
        extract_kt(tmp_path / "kt.whl", tmp_path / "kt_kernel")
