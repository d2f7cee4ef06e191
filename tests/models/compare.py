"""Shared by the model tests: save a transformers model, load it with hybridmoe, run both.

Imported by the test files beside it (pytest puts this directory on sys.path).
B sequences, T tokens, V vocab, H hidden.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybridmoe.config import EngineConfig
from hybridmoe.engine.context import Context, use_context
from hybridmoe.weights.loader import LoadedModel, load_model

TOLERANCE = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=5e-2, rtol=5e-2),
}
"""One table for every comparison of our outputs with transformers' (logits, hidden states)."""


def save_and_load(hf_model, path: Path, max_shard_size: str | None = None, **engine_options) -> LoadedModel:
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    hf_model.save_pretrained(path, **kwargs)
    return load_model(path, EngineConfig(**engine_options))


@torch.no_grad()
def hf_forward(hf_model, ids: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One sequence through transformers: logits [T, V] float32 and hidden_states (L + 1) x [T, H]."""
    out = hf_model(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0].float(), [h[0] for h in out.hidden_states]


@torch.no_grad()
def run_step(model, chunks: list[list[int]], slots: list[int], start_pos: list[int],
             hidden_states_out: list | None = None) -> list[torch.Tensor]:
    """One engine step: sequence b brings chunks[b] at positions start_pos[b].. into cache slot slots[b].

    Returns each sequence's logits [len(chunks[b]), V] float32.
    """
    cu = [0]
    for c in chunks:
        cu.append(cu[-1] + len(c))
    ids = torch.tensor([t for c in chunks for t in c])
    positions = torch.cat([torch.arange(p, p + len(c)) for c, p in zip(chunks, start_pos)])
    with use_context(Context(slot_ids=list(slots), start_pos=list(start_pos), cu_seqlens=cu)):
        hidden = model(ids, positions, hidden_states_out)
    logits = model.compute_logits(hidden)
    return [logits[cu[b]:cu[b + 1]] for b in range(len(chunks))]


def assert_close(ours: torch.Tensor, theirs: torch.Tensor, dtype=torch.float32, what: str = "") -> None:
    torch.testing.assert_close(ours.float(), theirs.float(), **TOLERANCE[dtype], msg=lambda m: f"{what}: {m}")
