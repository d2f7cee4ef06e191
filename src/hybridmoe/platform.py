"""What this installation can run, asked once and shared by every layer: nothing here imports the rest
of hybridmoe, so the tensor layers, the expert backends and the engine all read the same facts."""

from __future__ import annotations

import importlib.util

HAVE_TRITON = importlib.util.find_spec("triton") is not None
"""Whether triton is installed: the CUDA kernels under layers/ and experts/ that are written in it run only then
(each also checks that its tensors are on CUDA)."""


def native_engine_built() -> bool:
    """Whether the C++ expert engine (hybridmoe._native) was built and imports on this machine."""
    try:
        from hybridmoe import _native  # noqa: F401
    except ImportError:
        return False
    return True
