"""Peak resident memory (RSS) of loading a model, measured in a fresh process.

The peak (VmHWM) belongs to a whole process, so each measurement runs in its own child:

    python -m hybridmoe.bench.load_rss MODEL_DIR '{"expert_format": "int4", ...}' [WARMUP_DIR]

prints one JSON object (what measure_load returns). Growth is counted from the RSS after the
imports (and after WARMUP_DIR's load, if given), so it is what the load itself added: the model's
non-expert weights, the packed experts, and whatever the load path holds beside them (source pages
mapped from the checkpoint, copies).
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

import hybridmoe.experts.cpu_experts  # noqa: F401  (imported before the baseline: the load's growth is its own)
from hybridmoe.checkpoint.presets import model_config
from hybridmoe.checkpoint.safetensors_writer import write_random_safetensors
from hybridmoe.checkpoint.tensors import tensor_specs
from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model

_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")


def write_one_layer(out: Path, arch: str, preset: str, dtype: str = "bf16", **overrides) -> int:
    """A random checkpoint of `preset` (bf16, or block-FP8 linears: make-model's dtypes) cut to one decoder layer
    (a MoE one), config fields overridden, written into out (no tokenizer: loading needs none); returns its routed
    experts' bytes."""
    config = model_config(arch, preset, layers=1, dtype=dtype)
    config.update(bos_token_id=0, eos_token_id=1, **overrides)
    specs = tensor_specs(config)
    write_random_safetensors(out, specs, seed=0, progress=False)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return sum(s.nbytes for s in specs if ".mlp.experts." in s.name)


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


def measure_load(model_dir: str | Path, engine_options: dict, warmup_dir: str | Path | None = None) -> dict:
    """Load model_dir with EngineConfig(**engine_options) in this process; RSS figures in bytes.

    warmup_dir: a small model loaded first with the same options, so that what a process pays once
    (lazy imports, the engine's thread pool; ~80 MB) is not counted as the load's (warmup_growth says it)."""
    warmup = memory_status()["VmRSS"]
    if warmup_dir is not None:
        load_model(warmup_dir, EngineConfig(**engine_options))
    warmup = memory_status()["VmRSS"] - warmup
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
    # the native backend's layers, or a hybrid's CPU engines (None where every expert is on the GPU)
    engine = getattr(experts, "layer_experts", None) or experts.cpu_engine
    packed = sum(e.packed_bytes for e in map(engine, experts.layers()) if e is not None)
    non_expert = sum(t.numel() * t.element_size() for t in (*loaded.model.parameters(), *loaded.model.buffers())
                     if t.device.type == "cpu")
    return {"seconds": seconds, "packed_bytes": packed, "non_expert_bytes": non_expert, "warmup_growth": warmup,
            "peak_growth": end["VmHWM"] - base["VmRSS"], "after_growth": end["VmRSS"] - base["VmRSS"],
            "at_peak": {k: at_peak[k] - base[k] for k in ("RssAnon", "RssFile", "RssShmem")}}


def measure_in_subprocess(model_dir: str | Path, engine_options: dict, warmup_dir: str | Path | None = None,
                          timeout: float | None = None) -> dict:
    """measure_load in a fresh Python process (its own VmHWM); RuntimeError with the child's stderr on failure."""
    warmup = [] if warmup_dir is None else [str(warmup_dir)]
    done = subprocess.run([sys.executable, "-m", "hybridmoe.bench.load_rss", str(model_dir),
                           json.dumps(engine_options), *warmup], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"measuring the load of {model_dir} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    model_dir, options = sys.argv[1], json.loads(sys.argv[2])
    warmup_dir = sys.argv[3] if len(sys.argv) > 3 else None
    print(json.dumps(measure_load(model_dir, options, warmup_dir)))


if __name__ == "__main__":
    main()
