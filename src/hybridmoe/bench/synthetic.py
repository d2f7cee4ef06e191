"""A random-weight checkpoint written to memory (tmpfs) for one benchmark process: make-model's own
writer into a temporary directory under /dev/shm, so the engine loads it through the same code path
as any model directory, and the weights never touch a disk (a full-depth real shape may not fit one).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hybridmoe.checkpoint.make import CheckpointSummary, make_checkpoint
from hybridmoe.checkpoint.presets import PRESETS, model_config
from hybridmoe.errors import HybridMoEError

TMPFS = Path("/dev/shm")


def arch_of_preset(preset: str) -> str:
    """The architecture a preset name belongs to (real-shape names are unique; "tiny" is not)."""
    archs = [arch for arch, presets in PRESETS.items() if preset in presets]
    if len(archs) != 1:
        real = sorted(p for presets in PRESETS.values() for p in presets if p != "tiny")
        raise HybridMoEError(f"--synthetic takes one of {', '.join(real)} (or ARCH:tiny), got {preset!r}")
    return archs[0]


def split_preset(spec: str) -> tuple[str, str]:
    """"qwen3-30b-a3b" or "qwen3_moe:tiny" -> (arch, preset)."""
    if ":" in spec:
        arch, preset = spec.split(":", 1)
        model_config(arch, preset)  # unknown names raise here
        return arch, preset
    return arch_of_preset(spec), spec


def full_config(spec: str) -> dict:
    """config.json of the preset at its full depth (what a cut checkpoint stands for)."""
    return model_config(*split_preset(spec))


@contextmanager
def synthetic_checkpoint(spec: str, layers: int | None = None, *, seed: int = 0, root: str | Path | None = None,
                         progress: bool = False) -> Iterator[CheckpointSummary]:
    """Write preset `spec` (cut to `layers`) under root (default: /dev/shm when it exists), yield its
    summary, and delete it on exit."""
    arch, preset = split_preset(spec)
    base = Path(root) if root is not None else TMPFS if TMPFS.is_dir() else None
    out = Path(tempfile.mkdtemp(prefix="hybridmoe-synthetic-", dir=base))
    try:
        yield make_checkpoint(arch, preset, out, layers=layers, seed=seed, force=True, progress=progress)
    finally:
        shutil.rmtree(out, ignore_errors=True)
