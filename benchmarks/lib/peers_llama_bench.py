"""llama-bench on one GGUF file: its command line and its JSON (`-o json`) read into one row per test.

llama-bench runs each prompt length as its own test (pp<N>: N tokens prefilled into an empty context) and the
generation as another (tg<N>: N tokens decoded one at a time from an empty context), each repeated -r times
after a warm-up; a row carries the mean tok/s over the repetitions, its spread and every sample.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass

from hybridmoe.errors import HybridMoEError


@dataclass(frozen=True)
class BenchRow:
    test: str
    """"pp512", "tg64": prompt processing or text generation, and its tokens."""
    tokens: int
    tok_s: float
    """Mean over the repetitions, as llama-bench reports it (avg_ts)."""
    stddev_tok_s: float
    samples_tok_s: tuple[float, ...]
    n_cpu_moe: int
    threads: int
    backends: str
    cpu_info: str
    gpu_info: str
    build_commit: str


def llama_bench_command(binary: str, model: str, threads: int, prompt_lens: list[int], gen_len: int, reps: int,
                        ncmoe: int) -> list[str]:
    """Every layer on the GPU but the routed experts of the first ncmoe blocks, JSON on stdout."""
    return [binary, "-m", model, "-ngl", "99", "-ncmoe", str(ncmoe), "-t", str(threads),
            "-p", ",".join(map(str, prompt_lens)), "-n", str(gen_len), "-r", str(reps), "-o", "json"]


def bench_label(entry: dict) -> str:
    """llama-bench's own label of a test: pp<n_prompt>, tg<n_gen>, or pp<n>+tg<m> for a combined one."""
    p, g = int(entry.get("n_prompt", 0)), int(entry.get("n_gen", 0))
    depth = int(entry.get("n_depth", 0))
    name = f"pp{p}+tg{g}" if p and g else f"pp{p}" if p else f"tg{g}"
    return name + (f" @ d{depth}" if depth else "")


def parse_llama_bench(text: str) -> list[BenchRow]:
    """llama-bench -o json's stdout -> one row per test, in its order."""
    try:
        entries = json.loads(text)
    except json.JSONDecodeError as e:
        raise HybridMoEError(f"llama-bench's output is not JSON ({e}): {text[:200]!r}") from None
    if not isinstance(entries, list) or not entries:
        raise HybridMoEError(f"llama-bench's JSON holds no test: {text[:200]!r}")
    rows = []
    for e in entries:
        rows.append(BenchRow(test=bench_label(e), tokens=int(e.get("n_prompt", 0)) + int(e.get("n_gen", 0)),
                             tok_s=float(e["avg_ts"]), stddev_tok_s=float(e.get("stddev_ts", 0.0)),
                             samples_tok_s=tuple(float(v) for v in e.get("samples_ts", [])),
                             n_cpu_moe=int(e.get("n_cpu_moe", 0)), threads=int(e.get("n_threads", 0)),
                             backends=str(e.get("backends", "")), cpu_info=str(e.get("cpu_info", "")),
                             gpu_info=str(e.get("gpu_info", "")), build_commit=str(e.get("build_commit", ""))))
    return rows


def run_llama_bench(command: list[str], timeout_s: float | None = None) -> list[BenchRow]:
    """The rows of one llama-bench run; its log's last lines in the error when it fails."""
    print("+ " + " ".join(command), flush=True)
    try:
        done = subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise HybridMoEError(f"llama-bench ran past {timeout_s:.0f} s") from None
    if done.returncode != 0:
        tail = "\n".join(done.stderr.splitlines()[-20:])
        raise HybridMoEError(f"llama-bench failed (exit {done.returncode}):\n{tail}")
    return parse_llama_bench(done.stdout)
