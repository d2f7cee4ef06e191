"""What every peers table carries: the run's context (commit, host, command) and a comparison table with both
systems' figures, their ratio and the floor."""

from __future__ import annotations

import math
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def commit() -> str:
    """git rev-parse HEAD of the repository, "+dirty" when its tracked files differ from it."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    head = git("rev-parse", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_name() -> str | None:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def context() -> dict:
    """The run's commit, host and command line."""
    return {"commit": commit(), "cpu": cpu_model(), "gpu": gpu_name(), "python": platform.python_version(),
            "torch": torch.__version__, "command": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]])}


def context_lines(ctx: dict) -> list[str]:
    return [f"# commit {ctx['commit']}; host: {ctx['cpu']}, GPU {ctx['gpu'] or 'none'}; Python {ctx['python']}, "
            f"torch {ctx['torch']}", f"# command: {ctx['command']}"]


def fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """ours / theirs, None where either is missing or theirs is 0."""
    if ours is None or theirs is None or theirs == 0 or math.isnan(ours) or math.isnan(theirs):
        return None
    return ours / theirs


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table, its columns padded to their widest cell."""
    widths = [max(len(c) for c in col) for col in zip(head, *rows)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows]
