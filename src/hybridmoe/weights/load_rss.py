"""Peak resident memory (RSS) of loading a model, measured in a fresh process.

The peak (VmHWM) belongs to a whole process, so each measurement runs in its own child:

    python -m hybridmoe.weights.load_rss MODEL_DIR '{"expert_format": "int4", ...}'

prints one JSON object (what measure_load returns). Growth is counted from the RSS after the
imports, so it is what the load itself added: the model's non-expert weights, the packed experts,
and whatever the load path holds beside them (source pages mapped from the checkpoint, copies).
At the sampled peak RSS is split into RssAnon (the process's own memory), RssFile (pages mapped
from files on disk) and RssShmem (pages mapped from tmpfs, e.g. /dev/shm).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")


def memory_status() -> dict[str, int]:
    """/proc/self/status's RSS fields, in bytes (Linux)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in _FIELDS:
                out[key] = int(value.split()[0]) * 1024  # kB
    return out


def reset_peak() -> None:
    """Start VmHWM again from the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class _PeakSampler(threading.Thread):
    """Samples memory_status every `period` s and keeps the sample with the highest VmRSS, for the
    anon / file / shmem split near the peak (VmHWM itself is exact, the split is sampled)."""

    def __init__(self, period: float = 0.02):
        super().__init__(daemon=True)
        self.period, self.peak = period, memory_status()
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.period):
            s = memory_status()
            if s["VmRSS"] > self.peak["VmRSS"]:
                self.peak = s

    def stop(self) -> dict[str, int]:
        self._done.set()
        self.join()
        return self.peak


def measure_load(model_dir: str | Path, engine_options: dict) -> dict:
    """Load model_dir with EngineConfig(**engine_options) in this process; RSS figures in bytes."""
    from hybridmoe.config import EngineConfig
    from hybridmoe.weights.loader import load_model

    reset_peak()
    base = memory_status()
    sampler = _PeakSampler()
    sampler.start()
    start = time.perf_counter()
    loaded = load_model(model_dir, EngineConfig(**engine_options))
    seconds = time.perf_counter() - start
    at_peak = sampler.stop()
    end = memory_status()
    experts = loaded.experts
    packed = sum(experts.layer_experts(layer).packed_bytes for layer in experts.layers())
    non_expert = sum(t.numel() * t.element_size() for t in (*loaded.model.parameters(), *loaded.model.buffers())
                     if t.device.type == "cpu")
    return {"seconds": seconds, "packed_bytes": packed, "non_expert_bytes": non_expert,
            "peak_growth": end["VmHWM"] - base["VmRSS"], "after_growth": end["VmRSS"] - base["VmRSS"],
            "at_peak": {k: at_peak[k] - base[k] for k in ("RssAnon", "RssFile", "RssShmem")}}


def measure_in_subprocess(model_dir: str | Path, engine_options: dict, timeout: float | None = None) -> dict:
    """measure_load in a fresh Python process (its own VmHWM); RuntimeError with the child's stderr on failure."""
    done = subprocess.run([sys.executable, "-m", "hybridmoe.weights.load_rss", str(model_dir),
                           json.dumps(engine_options)], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"measuring the load of {model_dir} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    # Everything the load imports is imported before the baseline, so the growth is the load's own.
    import hybridmoe.experts.cpu_experts  # noqa: F401
    import hybridmoe.weights.loader  # noqa: F401

    model_dir, options = sys.argv[1], json.loads(sys.argv[2])
    print(json.dumps(measure_load(model_dir, options)))


if __name__ == "__main__":
    main()
