"""One setup of `finetune.py sft` in a process of its own, so that its peak RSS and GPU memory are its own and a
crash or an out-of-memory kill loses only its row.

    python3 -m benchmarks.lib.finetune_worker SPEC_JSON     (run from the repository root by finetune_bench.py)

SPEC: setup (finetune_setups.LOADERS), model_dir, device, seq_len, batch_size, warmup, steps, lora_rank, seed,
expert_format, cpu_threads, experts_implementation, checkpoint_bytes, result_file. The process writes result_file as
JSON: the row's measurements, {"skipped": why} or {"error": why} (the traceback goes to stderr).

The model loads as its setup says and gets LoRA adapters (finetune_setups.py); then warmup + steps training steps
run through hybridmoe.hf.training.train_step, the loop `hybridmoe finetune` runs (forward, cross-entropy over every
token, backward, gradient clipped to norm 1, AdamW on the adapters). Step i reads batch_size random sequences of
seq_len tokens drawn from seed + i, its labels its inputs, so every setup trains on the same tokens. tokens/s: the
timed steps' tokens over their seconds, the GPU synchronized around each step.
"""

from __future__ import annotations

import json
import sys
import time
import traceback

import torch

from hybridmoe.bench.load_rss import memory_status, reset_peak
from hybridmoe.hf.chat_data import Example
from hybridmoe.hf.training import train_step

from .finetune_setups import LOADERS, with_lora

GIB = 1 << 30
GPU_MARGIN_BYTES = 4 * GIB
"""What the all-on-GPU setup needs besides its weights (and a tenth of them): activations, logits and their
gradient, the adapters' optimizer state, the CUDA context."""


def token_batch(vocab_size: int, batch_size: int, seq_len: int, seed: int) -> list[Example]:
    """batch_size random sequences of seq_len tokens drawn from seed, each its own labels."""
    ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=torch.Generator().manual_seed(seed))
    return [Example(input_ids=row, labels=row, line=0) for row in ids.tolist()]


def gpu_room_problem(spec: dict, device: torch.device) -> str | None:
    """Why the all-on-GPU setup cannot fit, or None where its weights plus a margin fit the free GPU memory."""
    if spec["setup"] != "gpu" or device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    need = spec["checkpoint_bytes"] * 1.1 + GPU_MARGIN_BYTES
    if need <= free:
        return None
    return (f"needs about {need / GIB:.1f} GiB (weights {spec['checkpoint_bytes'] / GIB:.1f} GiB + 10% + "
            f"{GPU_MARGIN_BYTES / GIB:.0f} GiB), {free / GIB:.1f} GiB free on {device}")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_timed(model, spec: dict, device: torch.device) -> tuple[list[float], list[float]]:
    """The seconds of each timed step (those after the warm-up steps) and the loss of every step, warm-up included
    (the first one's, before any update, is the loss of the model as loaded)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
    vocab = model.get_input_embeddings().weight.shape[0]
    model.train()
    seconds, losses = [], []
    for step in range(spec["warmup"] + spec["steps"]):
        batch = token_batch(vocab, spec["batch_size"], spec["seq_len"], spec["seed"] + step)
        synchronize(device)
        start = time.perf_counter()
        loss, _ = train_step(model, [batch], device, params, optimizer, max_grad_norm=1.0)
        synchronize(device)
        losses.append(loss)
        if step >= spec["warmup"]:
            seconds.append(time.perf_counter() - start)
    return seconds, losses


def measure(spec: dict) -> dict:
    """The setup's row: load, adapters, timed steps, memory (the process's peaks, and those of the steps alone)."""
    device = torch.device(spec["device"])
    problem = gpu_room_problem(spec, device)
    if problem:
        return {"skipped": problem}
    start = time.perf_counter()
    model, note = LOADERS[spec["setup"]](spec["model_dir"], device, spec)
    model, targets = with_lora(model, spec["lora_rank"], spec["seed"])
    load_s = time.perf_counter() - start
    loaded = {"load_s": load_s, "rss_loaded_gib": memory_status()["VmRSS"] / GIB,
              "gpu_loaded_gib": torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else None}
    load_peak = peaks(device)
    rss_peak_restarted = restart_peaks(device)
    seconds, losses = train_timed(model, spec, device)
    steps_peak = peaks(device)
    return {"tokens_per_s": spec["steps"] * spec["batch_size"] * spec["seq_len"] / sum(seconds), "step_s": seconds,
            "losses": losses, **loaded,
            "peak_rss_gib": max(load_peak["rss"], steps_peak["rss"]),
            "peak_gpu_gib": max(load_peak["gpu"], steps_peak["gpu"]) if device.type == "cuda" else None,
            "steps_peak_rss_gib": steps_peak["rss"] if rss_peak_restarted else None,
            "steps_peak_gpu_gib": steps_peak["gpu"],
            "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "lora_targets": targets, "note": note}


def peaks(device: torch.device) -> dict:
    """The peak RSS (VmHWM) and GPU memory allocated (None on the CPU) since the last restart_peaks, or since the
    process started, in GiB."""
    gpu = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None
    return {"rss": memory_status()["VmHWM"] / GIB, "gpu": gpu}


def restart_peaks(device: torch.device) -> bool:
    """Start both peaks again from now; whether the RSS peak could be (Linux's clear_refs)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        reset_peak()
        return True
    except OSError:
        return False


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    try:
        result = measure(spec)
    except Exception as e:  # noqa: BLE001 (the row says what went wrong; the parent goes on with the other setups)
        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {e}"}
    with open(spec["result_file"], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
