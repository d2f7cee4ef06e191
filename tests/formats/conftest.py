"""Tiny checkpoints the format tests convert, quantize and load (written once per session), and a converted
directory of one (int4, group 32) for the tests that damage it."""

import pytest

from hybridmoe.checkpoint import make_checkpoint
from hybridmoe.weights.convert import convert_checkpoint


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    """A float32 Qwen3-MoE tiny checkpoint: 2 layers, 8 experts of [32, 64]."""
    out = tmp_path_factory.mktemp("qwen3") / "src"
    make_checkpoint("qwen3_moe", "tiny", out, dtype="fp32", seed=1, progress=False)
    return out


@pytest.fixture
def converted(tiny_qwen3, tmp_path):
    """tiny_qwen3 converted to int4 (group 32) in a directory of the test's own."""
    out = tmp_path / "conv"
    convert_checkpoint(tiny_qwen3, out, format="int4", group_size=32, threads=1, progress=False)
    return out
