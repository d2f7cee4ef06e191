"""Everything outside tests/device is the CPU suite, the one CI runs on a machine without a GPU. On a machine
with one it still runs on the CPU ("auto" resolves to it), so that its CPU references and expectations hold
there too; tests marked `device` (tests/device) are the ones that test the GPU."""

import pytest
import torch

from hybridmoe.checkpoint.make import make_checkpoint


@pytest.fixture(autouse=True)
def _cpu_suite_sees_no_gpu(request, monkeypatch):
    if request.node.get_closest_marker("device") is None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture(scope="session")
def tiny_qwen3_fp32(tmp_path_factory):
    """make-model's tiny Qwen3-MoE checkpoint in float32 (seed 0), written once for the session: tests that
    change a file copy the directory first."""
    out = tmp_path_factory.mktemp("tiny_qwen3_fp32")
    make_checkpoint("qwen3_moe", "tiny", out, dtype="fp32", progress=False)
    return out
