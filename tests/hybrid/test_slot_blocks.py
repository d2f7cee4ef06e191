"""slot_blocks, the layout of the Triton GPU share: slots grouped by expert into blocks of one
expert each, in shapes fixed by S, E and the block size, covering every kept slot exactly once.

S slots, E experts here (sid == E: a slot not on this GPU), NB blocks.
"""

import pytest
import torch

from hybridmoe.experts.gpu_experts import block_size, slot_blocks


@pytest.mark.parametrize("S, E, block, seed", [(1, 4, 16, 0), (8, 60, 16, 1), (64, 5, 16, 2), (500, 7, 64, 3),
                                               (11, 5, 2, 4), (40, 3, 4, 5)])
def test_slot_blocks_cover_each_kept_slot_once_in_blocks_of_one_expert(S, E, block, seed):
    g = torch.Generator().manual_seed(seed)
    sid = torch.randint(0, E + 1, (S,), generator=g)  # E + 1 values: E is "not here"
    block_expert, block_slots = slot_blocks(sid, E, block)
    NB = -(-S // block) + E
    assert block_expert.shape == (NB,) and block_slots.shape == (NB, block)
    counts = torch.bincount(sid, minlength=E + 1)[:E]
    used = int((-(-counts // block)).sum())
    assert bool((block_expert[:used] >= 0).all()) and bool((block_expert[used:] == -1).all())
    assert bool((block_slots[used:] == -1).all())
    for b in range(used):
        slots = block_slots[b][block_slots[b] >= 0]
        assert slots.numel() > 0 and bool((sid[slots] == block_expert[b]).all())
    kept = block_slots[block_slots >= 0]
    assert sorted(kept.tolist()) == (sid < E).nonzero().flatten().tolist()


def test_block_size_grows_with_the_slots_each_expert_gets():
    assert block_size(8, 60) == 16  # decode: a slot or two per expert
    assert block_size(64 * 8, 8) == 64  # prefill: many per expert
    assert block_size(100, 0) == 64  # no experts here: any size, never a zero division
