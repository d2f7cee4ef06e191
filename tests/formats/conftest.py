"""Tiny checkpoints the format tests convert, quantize and load (written once per session)."""

import pytest

from hybridmoe.checkpoint import make_checkpoint


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """A float32 Qwen3-MoE tiny checkpoint: 2 layers, 8 experts of [32, 64]."""
    out = tmp_path_factory.mktemp("qwen3") / "src"
    make_checkpoint("qwen3_moe", "tiny", out, dtype="fp32", seed=1, progress=False)
    return out
