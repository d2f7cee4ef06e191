"""GatedDeltaNet (layers/linear_attention.py) on its Triton path (layers/gated_deltanet_triton.py) against its torch
path (fused off, the reference): the same layer's outputs, its slots' and snapshots' states and their positions
after every step of a run that covers what the engine asks of it, for both row layouts of the input projections,
float32 and bfloat16:
  - a prefill of three sequences from position 0, one saving snapshots inside its tokens (the kernels run in rounds
    of segments) and one at its end;
  - a prefill continuing one sequence across the rule's chunk bound beside another that restores a snapshot into its
    slot and saves one after 3 tokens;
  - an eager decode step with a restore and a save;
  - two fixed-shape decode steps (DecodeBatch: slots and lengths on the device, a sequence at position 0, two
    padding rows on the spare slot), their host share run around them as the engine runs it;
and a layer without state (a model run outside the engine) prefilling from zeros.

Runs on CUDA, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1, triton installed; the layer's
TRITON_ON_CPU set), with the interpreter fixtures of test_gated_deltanet_triton.py; skips otherwise.
"""

import copy

import pytest
import torch
from kernels_device import kernels_device

DEVICE = kernels_device()

from test_gated_deltanet_triton import (  # noqa: F401  (the interpreter's fixtures, autouse)
    _interpreter_indexes_with_one_element_arrays,
    _interpreter_rounds_to_bfloat16_to_nearest_even,
)

from hybridmoe.forward_context import Context, DecodeBatch, use_context
from hybridmoe.layers import linear_attention
from hybridmoe.layers.linear_attention import GatedDeltaNet

pytestmark = pytest.mark.device

HIDDEN, HK, HV, DK, DV, KERNEL = 64, 2, 4, 24, 48, 4
SLOTS, SNAPSHOTS = 4, 3
SPARE = SLOTS  # the padding rows' slot: allocate_state gets SLOTS + 1
TOL = {torch.float32: {"atol": 1e-3, "rtol": 1e-3}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
"""float32: the kernels' sums and chunk inverses round unlike torch's; bfloat16: an output an ulp apart where the
convolution's float32 sum rounds to the other side."""


@pytest.fixture(autouse=True)
def _kernels_on_cpu_tensors(monkeypatch):
    if DEVICE == "cpu":
        monkeypatch.setattr(linear_attention, "TRITON_ON_CPU", True)


def make_layers(flat: bool, dtype: torch.dtype, stateful: bool = True) -> tuple[GatedDeltaNet, GatedDeltaNet]:
    """(Triton path, torch path): one random layer twice, each with SLOTS + 1 slots and SNAPSHOTS snapshots."""
    torch.manual_seed(7)
    layer = GatedDeltaNet(HIDDEN, HK, HV, DK, DV, KERNEL, 1e-6, flat_projections=flat)
    with torch.no_grad():
        layer.A_log.uniform_(-1.0, 1.0)
        layer.dt_bias.uniform_(-1.0, 1.0)
        layer.norm.weight.uniform_(0.5, 1.5)
    layer = layer.to(DEVICE, dtype)
    ref = copy.deepcopy(layer)
    ref.fused = False
    probe = torch.empty(0, device=DEVICE)
    assert layer._kernels(probe) and not ref._kernels(probe)  # the two paths the test holds to each other
    if stateful:
        for each in (layer, ref):
            each.allocate_state(SLOTS + 1, SNAPSHOTS)
    return layer, ref


@torch.no_grad()
def run_both(fast: GatedDeltaNet, ref: GatedDeltaNet, ctx: Context, x: torch.Tensor, rows: int | None = None,
             host: Context | None = None) -> None:
    """One step of both layers on x; their first `rows` outputs (all: None), and then their states, equal. host: a
    fixed-shape step's host share, run around it (DeltaNetState.begin_step, end_decode_step)."""
    outs = []
    for layer in (fast, ref):
        if host is not None:
            layer.state.begin_step(host)
        with use_context(ctx):
            outs.append(layer(x, torch.zeros(x.shape[0], dtype=torch.long, device=DEVICE))[:rows])
        if host is not None:
            layer.state.end_decode_step(host)
    torch.testing.assert_close(outs[0], outs[1], **TOL[x.dtype])
    if fast.state is not None:
        kept = [r for r in range(SLOTS + 1 + SNAPSHOTS) if r != SPARE]  # the spare slot's state is garbage
        torch.testing.assert_close(fast.state.conv[kept], ref.state.conv[kept], atol=0, rtol=0)  # input copies
        torch.testing.assert_close(fast.state.recurrent[kept], ref.state.recurrent[kept], **TOL[x.dtype])
        assert fast.state.positions == ref.state.positions


def tokens(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def fixed_step(slots: list[int], starts: list[int], pad: int, saves=()) -> tuple[Context, Context]:
    """A fixed-shape decode step of rows on slots at positions starts, padded with `pad` rows on the spare slot:
    (its device context, its host share's context)."""
    decode = DecodeBatch(torch.tensor(slots + [SPARE] * pad, device=DEVICE),
                         torch.tensor([p + 1 for p in starts] + [1] * pad, device=DEVICE), pad_len=128)
    host = Context(slot_ids=slots, start_pos=starts, cu_seqlens=list(range(len(slots) + 1)),
                   state_saves=list(saves))
    return Context(slot_ids=[], start_pos=[], cu_seqlens=[0], decode=decode), host


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("flat", [False, True], ids=["per-key-head", "flat"])
def test_prefill_with_saves_and_restores_then_decode_steps_match_the_torch_path(flat, dtype):
    fast, ref = make_layers(flat, dtype)
    # slots 2, 0, 3: 70 tokens (snapshot 0 after 40, snapshot 2 after all 70), 5 (snapshot 1 after all), 1
    run_both(fast, ref, Context(slot_ids=[2, 0, 3], start_pos=[0, 0, 0], cu_seqlens=[0, 70, 75, 76],
                                state_saves=[(0, 40, 0), (0, 70, 2), (1, 5, 1)]), tokens(76, dtype, 1))
    # slot 2 on to 90 (across the chunk bound at 64 from its step's start); slot 1 from snapshot 0 (40 positions),
    # 10 tokens, snapshot 2 after 3 of them
    run_both(fast, ref, Context(slot_ids=[2, 1], start_pos=[70, 40], cu_seqlens=[0, 20, 30],
                                state_restores=[(1, 0)], state_saves=[(1, 3, 2)]), tokens(30, dtype, 2))
    # one token each; slot 3 from snapshot 1 (5 positions); slot 0's state after its token into snapshot 0
    run_both(fast, ref, Context(slot_ids=[2, 0, 1, 3], start_pos=[90, 5, 50, 5], cu_seqlens=[0, 1, 2, 3, 4],
                                state_restores=[(3, 1)], state_saves=[(1, 1, 0)]), tokens(4, dtype, 3))
    # fixed shapes: slot 3 starts a sequence at position 0; two padding rows; slot 2 kept in snapshot 1
    ctx, host = fixed_step([1, 2, 0, 3], [51, 91, 6, 0], pad=2, saves=[(1, 1, 1)])
    run_both(fast, ref, ctx, tokens(6, dtype, 4), rows=4, host=host)
    ctx, host = fixed_step([1, 2, 0, 3], [52, 92, 7, 1], pad=2)
    run_both(fast, ref, ctx, tokens(6, dtype, 5), rows=4, host=host)
    assert fast.state.positions[:SLOTS] == [8, 53, 93, 2]
    assert fast.state.positions[SLOTS + 1:] == [6, 92, 43]  # the snapshots


def test_a_layer_without_state_prefills_from_zeros():
    fast, ref = make_layers(flat=False, dtype=torch.float32, stateful=False)
    run_both(fast, ref, Context(slot_ids=[0, 1], start_pos=[0, 0], cu_seqlens=[0, 66, 69]),
             tokens(69, torch.float32, 6))
