"""SafetensorsCheckpoint.release: a tensor's pages, read through the file's mapping, leave the process's RSS
(RssFile on disk, RssShmem on tmpfs) while the file stays open, and the tensor still reads the same."""

import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hybridmoe.bench.load_rss import memory_status
from hybridmoe.weights.safetensors import SafetensorsCheckpoint

MIB = 1 << 20


def _roots():
    yield "disk", None
    if Path("/dev/shm").is_dir():
        yield "tmpfs", "/dev/shm"


@pytest.mark.parametrize("kind,root", list(_roots()))
def test_release_drops_the_pages_and_keeps_the_values(kind, root):
    field = {"disk": "RssFile", "tmpfs": "RssShmem"}[kind]
    out = Path(tempfile.mkdtemp(dir=root))
    try:
        weights = {"a": torch.randn(2048, 4096), "b": torch.randn(1000, 7)}  # a: 32 MiB
        save_file(weights, out / "model.safetensors")
        with SafetensorsCheckpoint(out) as ckpt:
            before = memory_status()[field]
            a = ckpt.get("a")
            assert torch.equal(a, weights["a"])  # reads every page of a
            read = memory_status()[field]
            assert read - before >= 30 * MIB
            ckpt.release("a")
            assert read - memory_status()[field] >= 30 * MIB  # (library code pages count in RssFile too)
            ckpt.release("b")  # smaller than two pages' span inside: nothing to drop, no error
            assert torch.equal(a, weights["a"]) and torch.equal(ckpt.get("b"), weights["b"])
    finally:
        shutil.rmtree(out)
