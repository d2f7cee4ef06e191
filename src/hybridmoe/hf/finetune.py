"""finetune: LoRA adapters trained on chat conversations for a transformers MoE model whose routed experts run in
hybridmoe's native CPU engine (`hybridmoe finetune`).

The model loads through hybridmoe.hf.from_pretrained (routed experts packed for the CPU engine in expert_format,
everything else transformers' model, moved to `device`), peft wraps it with LoRA adapters on lora_targets
(lora_targets.py; attention by default), and training.py trains them on the conversations of a JSONL file
(chat_data.py: assistant tokens only). The routed experts stay frozen: their backward (CpuExperts.backward) gives
the gradients of their input and routing weights, so the adapters of every layer and anything before the experts
get theirs. The adapter is written to out_dir as peft's save_pretrained writes it (adapter_config.json,
adapter_model.safetensors), which peft loads and `--lora DIR` reads; checkpoints go to out_dir/checkpoint-STEP.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hybridmoe.errors import HybridMoEError
from hybridmoe.hf.chat_data import ChatData, load_chat_data, read_conversations
from hybridmoe.hf.lora_targets import lora_target_modules
from hybridmoe.hf.pretrained import from_pretrained
from hybridmoe.hf.train_checkpoint import RunKey, checkpoints
from hybridmoe.hf.training import TrainPlan, train


@dataclass(frozen=True)
class FinetuneOptions:
    model_dir: Path
    data: Path
    out_dir: Path
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_targets: str = "attention"
    plan: TrainPlan = field(default_factory=TrainPlan)
    max_length: int = 2048
    expert_format: str = "bf16"
    expert_group_size: int | None = None
    dtype: str = "auto"
    """The dtype of the model's weights other than the routed experts ("auto": the checkpoint's)."""
    device: str = "auto"
    """Where those weights compute ("auto": cuda where there is one, else cpu); the routed experts stay on the CPU."""
    cpu_threads: int | None = None
    resume: bool = False


@dataclass(frozen=True)
class FinetuneResult:
    adapter_dir: Path
    losses: list[float]
    """The loss of each step run here (not those before a resumed checkpoint)."""
    data: ChatData


def finetune(options: FinetuneOptions, show: Callable[[str], None] = print) -> FinetuneResult:
    """Train a LoRA adapter as the options say and write it to options.out_dir (module docstring)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer

    check_paths(options)
    tokenizer = AutoTokenizer.from_pretrained(options.model_dir)
    data = load_chat_data(options.data, tokenizer, options.max_length)
    show(data_summary(data, options))
    model = from_pretrained(options.model_dir, torch_dtype=options.dtype, expert_format=options.expert_format,
                            cpu_threads=options.cpu_threads, expert_group_size=options.expert_group_size)
    model.config.use_cache = False
    model.to(resolve_device(options.device))
    targets = lora_target_modules(options.lora_targets, model)
    config = LoraConfig(r=options.lora_rank, lora_alpha=options.lora_alpha, target_modules=targets, lora_dropout=0.0,
                        task_type="CAUSAL_LM")
    torch.manual_seed(options.plan.seed)  # peft draws the A matrices from torch's global generator
    model = get_peft_model(model, config)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    show(f"LoRA rank {options.lora_rank}, alpha {options.lora_alpha:g} on {', '.join(targets)}: {trainable:,} "
         f"trainable parameters; routed experts {options.expert_format} on the CPU (frozen)")
    key = RunKey(options.plan.batch_size, options.plan.grad_accum, options.plan.seed, len(data.examples),
                 options.lora_rank, float(options.lora_alpha), ",".join(targets))
    options.out_dir.mkdir(parents=True, exist_ok=True)
    losses = train(model, data.examples, options.plan, options.out_dir, options.resume, key, show)
    model.save_pretrained(options.out_dir)
    return FinetuneResult(options.out_dir, losses, data)


def check_paths(options: FinetuneOptions) -> None:
    """The data file readable and the output directory fit for a new run or for --resume, before the model loads."""
    read_conversations(options.data)  # a missing file or a bad line fails now, not after the model loaded
    out = options.out_dir
    if out.exists() and not out.is_dir():
        raise HybridMoEError(f"--out {out} is a file, not a directory")
    if options.resume:
        if not checkpoints(out):
            raise HybridMoEError(f"--resume: {out} holds no checkpoint-STEP directory to resume from (--save-every N "
                                 "writes them)")
    elif out.is_dir() and any(out.iterdir()):
        raise HybridMoEError(f"--out {out} is not empty; pick a new directory, or pass --resume to continue the run "
                             "whose checkpoints it holds")


def data_summary(data: ChatData, options: FinetuneOptions) -> str:
    tokens = sum(len(e.input_ids) for e in data.examples)
    trained = sum(e.trained_tokens for e in data.examples)
    line = (f"{len(data.examples)} conversations from {options.data}: {tokens:,} tokens, {trained:,} of them the "
            "assistant's (the loss covers those)")
    if data.too_long:
        shown = ", ".join(map(str, data.too_long[:10])) + (f" and {len(data.too_long) - 10} more"
                                                          if len(data.too_long) > 10 else "")
        line += (f"; skipped {len(data.too_long)} longer than --max-length {options.max_length} tokens "
                 f"(line{'s' if len(data.too_long) > 1 else ''} {shown})")
    return line


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError:
        raise HybridMoEError(f"--device {device!r} is no torch device (cpu, cuda, cuda:1, ...)") from None
