"""Shared by the model tests: save a transformers model, load it with hybridmoe, run both.

Imported by the test files beside it (pytest puts this directory on sys.path).
B sequences, T tokens, V vocab, H hidden.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import LoadedModel, load_model
from hybridmoe.forward_context import Context, use_context

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


def assert_forward_equals_transformers(ours, hf_model, prompt: list[int]) -> None:
    """Logits and every per-layer hidden state of one prompt equal transformers'."""
    ours.allocate_kv_cache(1, len(prompt))
    hidden: list[torch.Tensor] = []
    (logits,) = run_step(ours, [prompt], slots=[0], start_pos=[0], hidden_states_out=hidden)
    ref_logits, ref_hidden = hf_forward(hf_model, prompt)
    assert logits.dtype == torch.float32
    assert_close(logits, ref_logits, what="logits")
    assert len(hidden) == len(ref_hidden)
    for i in range(len(ref_hidden) - 1):  # transformers' last one is after the final norm; ours are all before
        assert_close(hidden[i], ref_hidden[i], what=f"hidden state {i}")


def assert_batched_decode_equals_recomputation(ours, hf_model, prompts: list[list[int]], slots: list[int],
                                               steps: int = 3) -> None:
    """Prefill prompts of different lengths together into their cache slots, then decode greedily
    for `steps` steps as one batch: every step's last logits equal transformers' full recomputation."""
    ours.allocate_kv_cache(max(slots) + 1, max(map(len, prompts)) + steps + 1)
    seqs = [list(p) for p in prompts]
    logits = run_step(ours, seqs, slots, start_pos=[0] * len(seqs))
    for step in range(steps):
        next_tokens = [int(l[-1].argmax()) for l in logits]
        for seq, logit in zip(seqs, logits):
            assert_close(logit[-1], hf_forward(hf_model, seq)[0][-1], what=f"step {step}, length {len(seq)}")
        start = [len(s) for s in seqs]
        for seq, t in zip(seqs, next_tokens):
            seq.append(t)
        logits = run_step(ours, [[t] for t in next_tokens], slots, start)
