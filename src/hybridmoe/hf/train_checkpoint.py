"""Training checkpoints of a LoRA fine-tune: OUT/checkpoint-STEP/ holds the adapter (peft's save_pretrained:
adapter_config.json, adapter_model.safetensors) and trainer_state.pt (the step, AdamW's state and the run's
RunKey), so that a run started again with --resume continues at the next step with the same optimizer state, the
same order of micro-batches and the same adapter shape.

A checkpoint is written to checkpoint-STEP.partial/ and renamed when complete: a run stopped while writing leaves
the previous checkpoint as the latest.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hybridmoe.errors import HybridMoEError

STATE_FILE = "trainer_state.pt"
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")


@dataclass(frozen=True)
class RunKey:
    """What a resumed run must share with the run it continues: what decides which conversations each step reads,
    and the adapter's shape and scale."""

    batch_size: int
    grad_accum: int
    seed: int
    conversations: int
    lora_rank: int
    lora_alpha: float
    lora_targets: str
    """The target module names, comma-separated."""


def checkpoints(out_dir: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every complete checkpoint in out_dir, by step."""
    if not out_dir.is_dir():
        return []
    found = [(int(m[1]), p) for p in out_dir.iterdir() if (m := _CHECKPOINT.fullmatch(p.name)) and p.is_dir()
             and (p / STATE_FILE).is_file()]
    return sorted(found)


def save_checkpoint(out_dir: Path, step: int, model, optimizer: torch.optim.Optimizer, key: RunKey) -> Path:
    """OUT/checkpoint-STEP with the adapter, the optimizer state, the step and the run's key."""
    final = out_dir / f"checkpoint-{step}"
    partial = out_dir / f"checkpoint-{step}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    torch.save({"step": step, "optimizer": optimizer.state_dict(), "run_key": asdict(key)}, partial / STATE_FILE)
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)
    return final


def resume_checkpoint(out_dir: Path, model, optimizer: torch.optim.Optimizer, key: RunKey) -> int:
    """Load the latest checkpoint of out_dir into model (its LoRA weights) and optimizer; its step."""
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    found = checkpoints(out_dir)
    if not found:
        raise HybridMoEError(f"--resume: {out_dir} holds no checkpoint-STEP directory to resume from")
    step, directory = found[-1]
    state = torch.load(directory / STATE_FILE, map_location="cpu", weights_only=True)
    saved = RunKey(**state["run_key"])
    if saved != key:
        changed = ", ".join(f"{name} {getattr(saved, name)} (now {getattr(key, name)})"
                            for name in asdict(key) if getattr(saved, name) != getattr(key, name))
        raise HybridMoEError(f"--resume: {directory} comes from a run with {changed}; resume with the same data, "
                             "--batch-size, --grad-accum, --seed and --lora-* options")
    adapter = load_file(directory / "adapter_model.safetensors")
    result = set_peft_model_state_dict(model, adapter)
    if result.unexpected_keys:
        raise HybridMoEError(f"--resume: {directory}'s adapter does not fit this model (it holds "
                             f"{result.unexpected_keys[0]}, which this model has not)")
    optimizer.load_state_dict(state["optimizer"])
    return step
