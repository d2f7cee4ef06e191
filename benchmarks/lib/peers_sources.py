"""The peers' sources, trimmed to what the GPU host builds and runs, into .peers/ (git-ignored, carried to the
GPU host, which has no network): llama.cpp from the tree the llama-cpp-python sdist vendors, and kt-kernel's
wheel cut down to its AMX and AVX-512-BF16 extensions.

    python3 benchmarks/peers.py sources --sdist llama_cpp_python-X.tar.gz --wheel kt_kernel-X-cp312-*.whl

llama.cpp keeps what llama-bench and llama-quantize build from: the top CMakeLists and cmake/, include/, src/,
common/, ggml with its CPU and CUDA backends only (the other backends' folders are left out: they are built
only when switched on), tools/llama-bench, tools/quantize and the vendored headers common uses; tools/ and
vendor/ CMakeLists lose the add_subdirectory lines of the folders left out. kt-kernel keeps its Python package
(the loader that picks an extension by cpuid, _cpu_detect.py), the two extensions and the shared libraries
they link (kt_kernel.libs/, found through the extensions' RPATH $ORIGIN/../kt_kernel.libs).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tarfile
import zipfile
from pathlib import Path

from hybridmoe.errors import HybridMoEError

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / ".peers"
LLAMA_DIR = PEERS / "llama.cpp"
KT_DIR = PEERS / "kt_kernel"

VENDORED = "vendor/llama.cpp/"
"""Where the sdist holds llama.cpp (under its top folder)."""
VENDORED_HEAD = ".git/modules/vendor/llama.cpp/HEAD"
"""The sdist's record of the llama.cpp commit it vendors (under its top folder)."""
PROVENANCE = "PEERS_SOURCE.json"
"""Written beside the sources: the sdist they come from and llama.cpp's commit (the build passes it on)."""
LLAMA_KEEP = ("CMakeLists.txt", "LICENSE", "cmake/", "include/", "src/", "common/", "ggml/CMakeLists.txt",
              "ggml/cmake/", "ggml/include/", "ggml/src/", "tools/CMakeLists.txt", "tools/llama-bench/",
              "tools/quantize/", "vendor/CMakeLists.txt", "vendor/nlohmann/", "vendor/sheredom/",
              "vendor/cpp-httplib/")
"""Paths under llama.cpp/ kept (a trailing / keeps the folder)."""
GGML_BACKENDS = ("ggml-cpu/", "ggml-cuda/")
"""The ggml/src backend folders kept; every other ggml/src/ggml-*/ folder is left out."""
PRUNED_CMAKELISTS = ("tools/CMakeLists.txt", "vendor/CMakeLists.txt")

KT_VARIANTS = ("amx", "avx512_bf16")
_KT_KEEP = re.compile(r"kt_kernel/(__init__|_cpu_detect|experts|experts_base)\.py|kt_kernel/utils/\w+\.py"
                      r"|kt_kernel/_kt_kernel_ext_(" + "|".join(KT_VARIANTS) + r")\.[\w.-]+\.so"
                      r"|kt_kernel\.libs/[\w.-]+|kt_kernel-[\w.]+\.dist-info/(METADATA|WHEEL|top_level\.txt)")


def add_arguments(parser) -> None:
    parser.add_argument("--sdist", required=True, help="llama-cpp-python's sdist (.tar.gz), which vendors llama.cpp")
    parser.add_argument("--wheel", required=True, help="kt-kernel's manylinux wheel (.whl)")
    parser.add_argument("--out", default=str(PEERS), help=f"where to write them (default {PEERS})")


def llama_member(name: str) -> str | None:
    """The path under llama.cpp/ an sdist member is written to, or None if it is left out."""
    _, sep, inner = name.partition("/" + VENDORED)
    if not sep or not inner:
        return None
    if inner.startswith("ggml/src/ggml-") and "/" in inner[len("ggml/src/"):]:
        if not inner[len("ggml/src/"):].startswith(GGML_BACKENDS):
            return None
    return inner if any(inner == k or (k.endswith("/") and inner.startswith(k)) for k in LLAMA_KEEP) else None


def kt_member(name: str) -> bool:
    """Whether a wheel member is kept."""
    return _KT_KEEP.fullmatch(name) is not None


def prune_subdirectories(text: str, kept: set[str]) -> str:
    """A CMakeLists.txt without the add_subdirectory(X) lines of folders X not in kept."""
    pattern = re.compile(r"^\s*add_subdirectory\(\s*([\w.-]+)\s*\)\s*$")
    return "\n".join(line for line in text.split("\n")
                     if (m := pattern.match(line)) is None or m.group(1) in kept)


def extract_llama(sdist: Path, out: Path) -> int:
    """The kept llama.cpp files of sdist under out (replaced), and PROVENANCE; their total bytes."""
    shutil.rmtree(out, ignore_errors=True)
    total, commit = 0, None
    with tarfile.open(sdist) as tar:
        for member in tar:
            if member.name.partition("/")[2] == VENDORED_HEAD and member.isfile():
                with tar.extractfile(member) as head:
                    commit = head.read().decode().strip()
            inner = llama_member(member.name)
            if inner is None or not member.isfile():
                continue
            dest = out / inner
            dest.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(member) as src, open(dest, "wb") as dst:
                shutil.copyfileobj(src, dst)
            dest.chmod(member.mode & 0o755 | 0o644)
            total += member.size
    if not (out / "CMakeLists.txt").is_file():
        raise HybridMoEError(f"{sdist} holds no {VENDORED}CMakeLists.txt; is it llama-cpp-python's sdist?")
    for rel in PRUNED_CMAKELISTS:
        path = out / rel
        kept = {p.name for p in path.parent.iterdir() if p.is_dir()}
        path.write_text(prune_subdirectories(path.read_text(), kept))
    (out / PROVENANCE).write_text(json.dumps({"sdist": sdist.name, "llama_cpp_commit": commit}, indent=1) + "\n")
    return total


def extract_kt(wheel: Path, out: Path) -> int:
    """The kept kt-kernel files of wheel under out (replaced); their total bytes."""
    shutil.rmtree(out, ignore_errors=True)
    total = 0
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if kt_member(info.filename):
                z.extract(info, out)
                total += info.file_size
    found = sorted(p.name for p in (out / "kt_kernel").glob("_kt_kernel_ext_*.so"))
    if len(found) != len(KT_VARIANTS):
        raise HybridMoEError(f"{wheel} holds extensions {found or 'none'}; expected one per variant "
                             f"{', '.join(KT_VARIANTS)} (is it kt-kernel's multi-variant wheel?)")
    return total


def ignore_peers() -> None:
    """/.peers/ in the repository's .git/info/exclude (what carry names must be ignored by git)."""
    exclude = Path(subprocess.run(["git", "rev-parse", "--git-path", "info/exclude"], cwd=ROOT, check=True,
                                  capture_output=True, text=True).stdout.strip())
    exclude = exclude if exclude.is_absolute() else ROOT / exclude
    lines = exclude.read_text().splitlines() if exclude.is_file() else []
    if "/.peers/" not in lines:
        exclude.parent.mkdir(parents=True, exist_ok=True)
        exclude.write_text("\n".join([*lines, "/.peers/"]) + "\n")


def run(args) -> int:
    out = Path(args.out)
    for path in (args.sdist, args.wheel):
        if not Path(path).is_file():
            raise HybridMoEError(f"{path} does not exist")
    llama = extract_llama(Path(args.sdist), out / "llama.cpp")
    kt = extract_kt(Path(args.wheel), out / "kt_kernel")
    if out.resolve() == PEERS.resolve():
        ignore_peers()
    print(f"{out / 'llama.cpp'}: {llama / 2**20:.1f} MiB\n{out / 'kt_kernel'}: {kt / 2**20:.1f} MiB")
    return 0
