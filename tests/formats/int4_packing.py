"""Packing int4 codes the way GPTQ and AWQ checkpoints store them, for the tests that write such checkpoints."""

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack(codes: torch.Tensor, dim: int, order=tuple(range(8))) -> torch.Tensor:
    """int codes 0..15 -> int32 with 8 per word along dim; slot j of a word holds element order[j] of its 8."""
    c = codes.movedim(dim, -1).to(torch.int64)
    c = c.reshape(*c.shape[:-1], -1, 8)[..., list(order)]
    words = sum(c[..., j] << (4 * j) for j in range(8))
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).movedim(-1, dim).contiguous()
