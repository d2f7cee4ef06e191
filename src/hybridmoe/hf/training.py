"""The LoRA training loop: AdamW on a peft model's trainable parameters, over chat Examples (chat_data.py).

Data order: each epoch shuffles the conversations (a permutation drawn from seed + epoch) and cuts them into
micro-batches of batch_size (the last one of an epoch may be smaller); the micro-batches of all epochs follow each
other, and each optimizer step takes the next grad_accum of them. A run is epochs of micro-batches (its last step
may take fewer) or exactly max_steps steps (as many epochs as that needs). Resuming from a step skips the micro-
batches before it, so the order does not depend on where a run stopped.

A step's loss is the mean cross-entropy over the assistant tokens of all its micro-batches (each micro-batch's sum
divided by the step's token count), so accumulating micro-batches gives the gradient of one large batch. The
gradient's norm is clipped to max_grad_norm (0: not clipped), then AdamW (no weight decay, constant lr) steps.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from hybridmoe.hf.chat_data import IGNORE, Example
from hybridmoe.hf.train_checkpoint import RunKey, resume_checkpoint, save_checkpoint
from hybridmoe.hf.train_progress import Progress

LOG_FILE = "train_log.jsonl"
"""One line per step in the output directory: {"step", "loss", "tokens", "seconds"}."""


@dataclass(frozen=True)
class TrainPlan:
    lr: float = 1e-4
    epochs: int = 1
    max_steps: int | None = None
    """Steps to run (epochs then does not count)."""
    batch_size: int = 1
    grad_accum: int = 8
    max_grad_norm: float = 1.0
    save_every: int | None = None
    """Steps between checkpoints (None: none but the final adapter)."""
    seed: int = 0

    def total_steps(self, conversations: int) -> int:
        if self.max_steps is not None:
            return self.max_steps
        return math.ceil(self.epochs * math.ceil(conversations / self.batch_size) / self.grad_accum)

    def total_micro_batches(self, conversations: int) -> int:
        if self.max_steps is not None:
            return self.max_steps * self.grad_accum
        return self.epochs * math.ceil(conversations / self.batch_size)


def train(model, examples: list[Example], plan: TrainPlan, out_dir: Path | None = None, resume: bool = False,
          run_key: RunKey | None = None, show: Callable[[str], None] | None = print) -> list[float]:
    """Train model's trainable parameters on examples; the loss of each step run here, in order.

    out_dir: where checkpoints (every plan.save_every steps, each with run_key) and LOG_FILE go (None: nowhere);
    resume: continue from out_dir's latest checkpoint, which must have been written with the same run_key; show:
    where the progress goes (train_progress.py; None: nowhere)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=plan.lr, weight_decay=0.0)
    done = resume_checkpoint(out_dir, model, optimizer, run_key) if resume else 0
    for group in optimizer.param_groups:  # this run's lr, also where the resumed optimizer state has another
        group["lr"] = plan.lr
    total = plan.total_steps(len(examples))
    device = model.get_input_embeddings().weight.device
    stream = itertools.islice(micro_batches(examples, plan), done * plan.grad_accum,
                              plan.total_micro_batches(len(examples)))
    losses = []
    model.train()
    progress = Progress(total, done, show)
    try:
        for step, group in enumerate(batched(stream, plan.grad_accum), start=done + 1):
            start = time.perf_counter()
            loss, tokens = train_step(model, group, device, params, optimizer, plan.max_grad_norm)
            seconds = time.perf_counter() - start
            losses.append(loss)
            progress.update(step, loss, tokens / seconds)
            if out_dir is not None:
                with (out_dir / LOG_FILE).open("a") as log:
                    log.write(json.dumps({"step": step, "loss": loss, "tokens": tokens, "seconds": seconds}) + "\n")
                if plan.save_every and step % plan.save_every == 0:
                    save_checkpoint(out_dir, step, model, optimizer, run_key)
    finally:
        progress.close()
    return losses


def train_step(model, group: list[list[Example]], device, params, optimizer, max_grad_norm: float
               ) -> tuple[float, int]:
    """One optimizer step over a group of micro-batches: (the step's mean loss, tokens read)."""
    batches = [collate(batch, device) for batch in group]
    targets = sum(int((labels[:, 1:] != IGNORE).sum()) for _, _, labels in batches)
    step_loss, tokens = 0.0, 0
    for input_ids, attention_mask, labels in batches:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE,
                               reduction="sum") / max(targets, 1)
        loss.backward()
        step_loss += loss.item()
        tokens += int(attention_mask.sum())
    if max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return step_loss, tokens


def micro_batches(examples: list[Example], plan: TrainPlan) -> Iterator[list[Example]]:
    """The run's micro-batches, epoch after epoch, without end (module docstring)."""
    for epoch in itertools.count():
        order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(plan.seed + epoch)).tolist()
        for i in range(0, len(order), plan.batch_size):
            yield [examples[j] for j in order[i:i + plan.batch_size]]


def batched(items: Iterator, n: int) -> Iterator[list]:
    """items in lists of n (the last one shorter where they run out)."""
    while group := list(itertools.islice(items, n)):
        yield group


def collate(batch: list[Example], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels) [B, longest], padded on the right (id 0, mask 0, label IGNORE)."""
    length = max(len(e.input_ids) for e in batch)
    input_ids = torch.zeros(len(batch), length, dtype=torch.long)
    attention_mask = torch.zeros(len(batch), length, dtype=torch.long)
    labels = torch.full((len(batch), length), IGNORE, dtype=torch.long)
    for row, example in enumerate(batch):
        n = len(example.input_ids)
        input_ids[row, :n] = torch.tensor(example.input_ids)
        attention_mask[row, :n] = 1
        labels[row, :n] = torch.tensor(example.labels)
    return input_ids.to(device), attention_mask.to(device), labels.to(device)
