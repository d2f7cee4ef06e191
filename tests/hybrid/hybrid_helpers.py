"""Shared by the hybrid tests: run a loaded model over one prompt, and a routed-expert reference.

Imported by the test files beside it (pytest puts this directory on sys.path).
T tokens, H hidden, V vocab, E experts, K experts per token.
"""

from __future__ import annotations

import torch

from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.forward_context import single_sequence_context, use_context

PROMPT = [5, 17, 3, 60, 22, 9, 41, 2, 99, 7, 13]
FP32 = dict(atol=1e-4, rtol=1e-4)


@torch.no_grad()
def prompt_logits(model, ids: list[int] = PROMPT) -> torch.Tensor:
    """[T, V] float32 logits of one sequence prefilled from position 0 (a fresh KV cache)."""
    model.allocate_kv_cache(1, 64)
    with use_context(single_sequence_context(len(ids))):
        return model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids))))


def load(path, **options):
    return load_model(path, EngineConfig(**options))
