"""A decode step in fixed shapes (DecodeBatch: slots and lengths as tensors, one padded length)
gives the logits of the variable-shape path, for GQA (Qwen, Mixtral) and MLA (DeepSeek).

B sequences, V vocab. A padding row (a spare slot, length 1), as a CUDA graph's bucket adds,
leaves the real rows' logits unchanged.
"""

import pytest
import torch
from compare import TOLERANCE, run_step

from hybridmoe.checkpoint.make import make_checkpoint
from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.forward_context import Context, DecodeBatch, use_context

PROMPTS = [[5, 17, 3, 60, 22, 9, 41], [7, 13], [99, 2, 8, 31, 4]]
SLOTS = [2, 0, 1]
SPARE = 3
MAX_LEN = 16


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "deepseek_v2", "deepseek_v3"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_checkpoint(request.param, "tiny", path, dtype="fp32", seed=3, progress=False)
    model = load_model(path, EngineConfig(device="cpu", expert_backend="torch")).model
    model.allocate_kv_cache(SPARE + 1, MAX_LEN)
    return model


@torch.no_grad()
def _fixed_step(model, tokens: list[int], slots: list[int], lens: list[int], pad_len: int) -> torch.Tensor:
    """One fixed-shape decode step: row b brings tokens[b] at position lens[b] - 1 -> logits [B, V]."""
    B = len(tokens)
    # The lists say "every row in the spare slot at position 0": only the tensors may be read.
    ctx = Context(slot_ids=[SPARE] * B, start_pos=[0] * B, cu_seqlens=list(range(B + 1)),
                  decode=DecodeBatch(torch.tensor(slots), torch.tensor(lens), pad_len))
    with use_context(ctx):
        return model.compute_logits(model(torch.tensor(tokens), torch.tensor(lens) - 1))


@pytest.mark.parametrize("pad_len", [8, MAX_LEN])  # the longest sequence's length, and the whole cache
def test_fixed_shape_decode_equals_the_variable_path(model, pad_len):
    logits = run_step(model, PROMPTS, SLOTS, start_pos=[0] * len(PROMPTS))
    tokens = [int(l[-1].argmax()) for l in logits]
    lens = [len(p) + 1 for p in PROMPTS]
    # Writing a step's keys twice writes the same values: the two paths see the same cache.
    want = torch.cat(run_step(model, [[t] for t in tokens], SLOTS, start_pos=[len(p) for p in PROMPTS]))
    got = _fixed_step(model, tokens + [0], SLOTS + [SPARE], lens + [1], pad_len)
    torch.testing.assert_close(got[:len(PROMPTS)], want, **TOLERANCE[torch.float32])
