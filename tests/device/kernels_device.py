"""Where a device test of Triton kernels runs: on CUDA with triton, else on the CPU under Triton's interpreter
(TRITON_INTERPRET=1, triton installed), else nowhere (the test module is skipped). Imported by the test files beside
it (pytest puts this directory on sys.path)."""

import importlib.util
import os

import pytest
import torch


def kernels_device() -> str:
    """"cuda", or "cpu" under the interpreter; skips the calling test module where neither runs the kernels."""
    if importlib.util.find_spec("triton") is not None:
        if torch.cuda.is_available():
            return "cuda"
        if os.environ.get("TRITON_INTERPRET") == "1":
            return "cpu"
    pytest.skip("needs triton, and a CUDA GPU or TRITON_INTERPRET=1", allow_module_level=True)
