"""`finetune.py sft`'s table and issue #31's targets, from the setups' rows (finetune_bench.py)."""

from __future__ import annotations

TARGET_OVER_ACCELERATE = 5.0
"""hybridmoe's tokens/s over accelerate's expert offload, at least."""
TARGET_OF_GPU = 0.5
"""hybridmoe's tokens/s over the all-GPU model's, at least (within 2x)."""

COLUMNS = ("model", "setup", "tok/s", "x accel", "x gpu", "GPU GiB", "RSS GiB", "RSS steps", "load s", "loss0",
           "how")


def number(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table_line(row: dict) -> list[str]:
    model = f"{row['model']}/{row['layers']}L"
    if "tokens_per_s" not in row:
        why = f"error: {row['error']}" if "error" in row else f"skipped: {row['skipped']}"
        return [model, row["setup"], *["-"] * (len(COLUMNS) - 3), " ".join(why.split())[:300]]
    return [model, row["setup"], number(row["tokens_per_s"], 1), number(row.get("x_accelerate")),
            number(row.get("x_gpu")), number(row["peak_gpu_gib"]), number(row["peak_rss_gib"]),
            number(row["steps_peak_rss_gib"]), number(row["load_s"], 1), number(row["losses"][0], 3), row["note"]]


def table(rows: list[dict]) -> str:
    lines = [list(COLUMNS)] + [table_line(row) for row in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)) + "  " + line[-1] for line in lines)


def target_lines(rows: list[dict], device: str) -> list[str]:
    """Per model, hybridmoe's ratios against issue #31's targets (on the CPU: shown, not judged)."""
    lines = []
    for model in dict.fromkeys(row["model"] for row in rows):
        ours = next((r for r in rows if r["model"] == model and r["setup"] == "hybridmoe"), None)
        if ours is None or "tokens_per_s" not in ours:
            lines.append(f"{model}: hybridmoe has no measurement (its row says why)")
            continue
        parts = []
        for key, target, what in (("x_accelerate", TARGET_OVER_ACCELERATE, "accelerate's"),
                                  ("x_gpu", TARGET_OF_GPU, "the all-GPU model's")):
            value = ours.get(key)
            if value is None:
                parts.append(f"no {what} tokens/s to compare with")
                continue
            verdict = "CPU smoke, not judged" if device == "cpu" else "met" if value >= target else "NOT met"
            parts.append(f"{value:.2f}x {what} tokens/s (target >= {target:g}x: {verdict})")
        accelerate = next((r for r in rows if r["model"] == model and r["setup"] == "accelerate"), {})
        if ours.get("peak_gpu_gib") and accelerate.get("peak_gpu_gib"):
            parts.append(f"peak GPU memory {ours['peak_gpu_gib']:.2f} GiB against accelerate's "
                         f"{accelerate['peak_gpu_gib']:.2f} GiB")
        lines.append(f"{model}: hybridmoe runs at " + "; ".join(parts))
    return lines


def print_report(rows: list[dict], device: str, tokens_per_step: int, notes: list[str]) -> None:
    print(f"\nLoRA SFT on {device}, {tokens_per_step} tokens a step. tok/s: over the timed steps; GPU GiB: peak "
          "allocated; RSS GiB: peak resident set of the setup's process, RSS steps: of its training steps alone; "
          "loss0: the first step's, before any update (the same weights and tokens: close across setups)")
    print(table(rows))
    for line in target_lines(rows, device) + notes:
        print(line)
