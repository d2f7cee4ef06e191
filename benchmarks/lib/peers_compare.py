"""One system's end-to-end figures in a common form (tok/s per llama-bench test, mean and spread over the
repetitions, the decode floor) and the table that sets two of them side by side."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from .peers_llama_bench import BenchRow
from .peers_report import fmt, ratio, table


@dataclass
class Figures:
    system: str
    """"llama.cpp Q4_K_M", "ours on the same file", "ours from safetensors int4"."""
    tok_s: dict[str, float]
    """llama-bench's test label (pp512, tg64) -> the mean of the repetitions' tok/s."""
    stddev: dict[str, float]
    floor_tok_s: float | None
    """Decode at the floor: the CPU-resident routed-expert bytes a token reads, at the host read bandwidth."""
    gpu_share: float
    """Share of the routed-expert bytes on the GPU."""
    placement: str
    """How the share was set: "-ncmoe 8", "12 GPU experts per MoE layer"."""
    samples: dict[str, list[float]] = field(default_factory=dict)

    def to_json(self) -> dict:
        return dict(vars(self))


def mean_sd(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value), as llama-bench reports its repetitions."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def llama_figures(system: str, rows: list[BenchRow], floor_tok_s: float | None, gpu_share: float,
                  ncmoe: int) -> Figures:
    return Figures(system, {r.test: r.tok_s for r in rows}, {r.test: r.stddev_tok_s for r in rows}, floor_tok_s,
                   gpu_share, f"-ncmoe {ncmoe}", {r.test: list(r.samples_tok_s) for r in rows})


def our_figures(system: str, result, gen_len: int, floor_tok_s: float, gpu_share: float, placement: str,
                warmup: int = 1) -> Figures:
    """A hybridmoe.bench.suite.SuiteResult's repetitions as llama-bench's tests (pp<n> per prompt length, tg<gen>),
    the first `warmup` of them left out as llama-bench leaves out its warm-up run of each test."""
    samples = {f"pp{n}": list(v[warmup:]) for n, v in result.prefill_samples.items()}
    samples[f"tg{gen_len}"] = [1.0 / d for d in result.decode_samples_s[warmup:]]
    stats = {test: mean_sd(v) for test, v in samples.items()}
    return Figures(system, {t: s[0] for t, s in stats.items()}, {t: s[1] for t, s in stats.items()}, floor_tok_s,
                   gpu_share, placement, samples)


def llama_floor_tok_s(expert_bytes: dict[int, int], ncmoe: int, num_experts: int, top_k: int,
                      bandwidth: float) -> float | None:
    """llama.cpp's decode floor in tok/s: top_k experts of each MoE block below ncmoe (on the CPU) read per token;
    None when every routed expert is on the GPU."""
    per_token = sum(top_k * b / num_experts for layer, b in expert_bytes.items() if layer < ncmoe)
    return bandwidth / per_token if per_token else None


def comparison_table(theirs: Figures, ours: Figures) -> list[str]:
    """One row per test both ran: each system's tok/s (mean ± sd), ours / theirs, and the decode floors."""
    head = ["test", f"{theirs.system} tok/s", f"{ours.system} tok/s", "ours / theirs", "floor tok/s (theirs)",
            "floor tok/s (ours)"]
    rows = []
    for test in [t for t in theirs.tok_s if t in ours.tok_s]:
        decode = test.startswith("tg")
        rows.append([test, f"{fmt(theirs.tok_s[test])} ± {fmt(theirs.stddev.get(test))}",
                     f"{fmt(ours.tok_s[test])} ± {fmt(ours.stddev.get(test))}",
                     fmt(ratio(ours.tok_s[test], theirs.tok_s[test]), ".2f"),
                     fmt(theirs.floor_tok_s) if decode else "-", fmt(ours.floor_tok_s) if decode else "-"])
    return table(head, rows)


def comparison_lines(title: str, theirs: Figures, ours: Figures) -> list[str]:
    """A comparison's heading (each side's placement and GPU share) and its table."""
    return [f"## {title}",
            f"# GPU share of the routed-expert bytes: {theirs.system} {theirs.gpu_share:.2f} ({theirs.placement}), "
            f"{ours.system} {ours.gpu_share:.2f} ({ours.placement})",
            *comparison_table(theirs, ours), ""]
