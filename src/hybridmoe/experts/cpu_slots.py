"""The CPU share of a step's routing as the native engine takes it: each token's kept slots made dense.

T tokens, K experts per token, Kc the most slots any token keeps.
"""

from __future__ import annotations

import torch


def compact_slots(ids: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The kept slots of each token as a dense [T, Kc] (Kc: the most any token keeps), or None if none.

    The native engine takes a dense [T, Kc] of distinct ids per token, so shorter rows are padded,
    with weight 0, by experts other tokens of the batch already use (no extra weight reads).
    """
    counts = keep.sum(dim=1)  # [T]
    width = int(counts.max()) if counts.numel() else 0
    if width == 0:
        return None
    order = torch.sort((~keep).to(torch.int32), dim=1, stable=True).indices[:, :width]  # kept slots first
    cids, cw = ids.gather(1, order), weights.gather(1, order)
    valid = torch.arange(width, device=ids.device) < counts.unsqueeze(1)  # [T, Kc]
    if bool(valid.all()):
        return cids, cw
    active = torch.unique(ids[keep])  # [n], n >= Kc distinct experts
    member = ((cids.unsqueeze(2) == active) & valid.unsqueeze(2)).any(dim=1)  # [T, n] a token's own experts
    free = torch.sort(member.to(torch.int32), dim=1, stable=True).indices  # the others first
    pad = active[free.gather(1, (torch.arange(width, device=ids.device) - counts.unsqueeze(1)).clamp(min=0))]
    return torch.where(valid, cids, pad), torch.where(valid, cw, torch.zeros_like(cw))


def two_part_slots(ids: torch.Tensor, weights: torch.Tensor, keep: torch.Tensor, own: int
                   ) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """compact_slots of the first `own` columns and of the others, side by side: (ids [T, a + b], weights, b) for
    the engine's submit_deferred (b deferred slots per token), or None if no slot is kept. A padding slot (weight 0)
    may repeat an expert of the token's other side, which the engine allows."""
    sides = [compact_slots(ids[:, cols], weights[:, cols], keep[:, cols]) for cols in (slice(0, own), slice(own, None))]
    present = [side for side in sides if side is not None]
    if not present:
        return None
    return (torch.cat([i for i, _ in present], 1).contiguous(), torch.cat([w for _, w in present], 1).contiguous(),
            sides[1][0].shape[1] if sides[1] is not None else 0)
