"""The gated delta rule's Triton kernels (layers/gated_deltanet_triton.py) against the torch path they replace,
written here as GatedDeltaNet runs it from layers/gated_deltanet.py's functions: causal_conv1d from the slot's conv
state, SiLU, q and k L2-normalized in float32 and repeated to the value heads (q scaled by Dk^-1/2), then
gated_delta_step (decode) or chunk_gated_delta_rule per sequence (prefill) from the slot's recurrent state; a
sequence without state starts from zeros.

Inputs in float32 and bfloat16 (states float32, the conv state in the inputs' dtype), dims that are no powers of two
(masked tiles) and more value heads than key heads. Decode runs several steps over shuffled slots, one slot in every
step so its state carries through them; prefill runs sequences of 1, 2, 63, 64 and 130 tokens (within, at and across
chunk bounds) from nonzero states, with a few tokens of strong decay. Every slot's states are compared after each
call: the ones a call names hold the reference's new states, the others are unchanged. A sequence without state sits
on a slot holding NaN, which shows if the kernels read it.

Runs on CUDA (also a CUDA graph's replay of the decode step with new slots), or on the CPU under Triton's interpreter
(TRITON_INTERPRET=1, triton installed); skips otherwise.
"""

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

if torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    DEVICE = "cuda"
elif os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
    DEVICE = "cpu"
else:
    pytest.skip("needs triton, and a CUDA GPU or TRITON_INTERPRET=1", allow_module_level=True)

from hybridmoe.layers.gated_deltanet import (
    causal_conv1d,
    chunk_gated_delta_rule,
    gated_delta_step,
    l2_normalize,
)
from hybridmoe.layers.gated_deltanet_triton import (  # triton: imported once it is known to be there
    triton_chunk_gated_delta_rule,
    triton_gated_delta_decode,
)

pytestmark = pytest.mark.device

HK, HV, DK, DV, KERNEL, SLOTS = 2, 4, 24, 48, 4, 7
CH = 2 * HK * DK + HV * DV
TOL = {torch.float32: {"atol": 2e-4, "rtol": 2e-4}, torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2}}
"""float32: the kernels' sums and the chunk's inverse round differently from torch's; bfloat16: the convolution's
output, rounded to bfloat16, can land an ulp apart when its float32 sum does."""


@pytest.fixture(autouse=True)
def _interpreter_indexes_with_one_element_arrays(monkeypatch):
    """On the CPU: Triton 3.5's interpreter takes a scalar as a loop bound through int() of its numpy data, a
    one-element array that NumPy >= 2.4 no longer converts (TypeError), so a loop over a loaded length fails there;
    here the bound is the array's one element, the value the GPU's loop runs to."""
    if DEVICE != "cpu":
        return
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor):
        patch_tensor(tensor)
        tensor.__index__ = lambda self: int(self.handle.data.item())

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch_lang_tensor)


@pytest.fixture(autouse=True)
def _interpreter_rounds_to_bfloat16_to_nearest_even(monkeypatch):
    """On the CPU: Triton 3.5's interpreter casts float32 to bfloat16 by dropping the low bits (toward zero), so a
    float32 -> bfloat16 cast takes torch's conversion here: round to nearest even, as the GPU's cvt.rn does."""
    if DEVICE != "cpu":
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    cast = interpreter.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return cast(self, src, dst_type)
        values = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
        return interpreter.TensorHandle(values.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16),
                                        tl.bfloat16)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "cast_impl", cast_impl)


def ref_heads(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The activated convolution's output [..., Ch] -> q, k [..., Hv, Dk] (normalized, repeated, q scaled) and v."""
    lead = y.shape[:-1]
    q, k, v = y.split([HK * DK, HK * DK, HV * DV], dim=-1)
    q, k = (l2_normalize(t.reshape(*lead, HK, DK).float()).repeat_interleave(HV // HK, dim=-2) for t in (q, k))
    return q * DK ** -0.5, k, v.reshape(*lead, HV, DV)


def ref_decode(mixed, g, beta, weight, conv_state, recurrent, slots, has_state):
    """One token per row through the torch path -> o [B, Hv, Dv]; conv_state, recurrent updated at slots."""
    going = has_state.to(mixed.device)
    conv = torch.where(going[:, None, None], conv_state[slots], 0)
    rec = torch.where(going[:, None, None, None], recurrent[slots], 0)
    out, conv = causal_conv1d(mixed[:, None], weight, conv)
    q, k, v = ref_heads(F.silu(out[:, 0]))
    o, rec = gated_delta_step(q, k, v, g, beta, rec)
    conv_state[slots] = conv
    recurrent[slots] = rec
    return o


def ref_prefill(mixed, g, beta, weight, conv_state, recurrent, slots, cu, has_state):
    """Each sequence's tokens through the torch path -> o [T, Hv, Dv]; conv_state, recurrent updated at slots."""
    outs = []
    for lo, hi, slot, going in zip(cu, cu[1:], slots.tolist(), has_state.tolist()):
        conv = conv_state[slot:slot + 1] if going else torch.zeros_like(conv_state[:1])
        rec = recurrent[slot] if going else torch.zeros_like(recurrent[0])
        out, conv = causal_conv1d(mixed[lo:hi][None], weight, conv)
        q, k, v = ref_heads(F.silu(out[0]))
        o, rec = chunk_gated_delta_rule(q, k, v, g[lo:hi], beta[lo:hi], rec)
        conv_state[slot] = conv[0]
        recurrent[slot] = rec
        outs.append(o)
    return torch.cat(outs)


def make_states(dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The convolution's weight [Ch, K] and nonzero states for SLOTS slots: conv [S, Ch, K - 1] in dtype,
    recurrent [S, Hv, Dk, Dv] float32."""
    weight = (0.5 * torch.randn(CH, KERNEL, generator=gen)).to(dtype)
    conv = torch.randn(SLOTS, CH, KERNEL - 1, generator=gen).to(dtype)
    rec = 0.3 * torch.randn(SLOTS, HV, DK, DV, generator=gen)
    return weight.to(DEVICE), conv.to(DEVICE), rec.to(DEVICE)


def make_tokens(n: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """n tokens' mixed [n, Ch] (dtype), g [n, Hv] float32 (about one in twenty -30: strong decay) and beta [n, Hv]
    (dtype) as the layer makes them."""
    mixed = torch.randn(n, CH, generator=gen).to(dtype)
    g = -F.softplus(torch.randn(n, HV, generator=gen)) * 0.5
    g = torch.where(torch.rand(n, HV, generator=gen) < 0.05, torch.full_like(g, -30.0), g)
    beta = torch.randn(n, HV, generator=gen).sigmoid().to(dtype)
    return mixed.to(DEVICE), g.to(DEVICE), beta.to(DEVICE)


def hide_unread_slots(conv: torch.Tensor, rec: torch.Tensor, slots: torch.Tensor, has_state: torch.Tensor) -> None:
    """NaN in the states of the slots of sequences without state, which the kernels must not read."""
    fresh = slots[~has_state.to(slots.device)]
    conv[fresh] = float("nan")
    rec[fresh] = float("nan")


def same_states(conv, rec, ref_conv, ref_rec, dtype):
    torch.testing.assert_close(conv, ref_conv, rtol=0, atol=0, equal_nan=True)  # copies of inputs: exact
    torch.testing.assert_close(rec, ref_rec, equal_nan=True, **TOL[dtype])


def decode_both(weight, states, ref_states, slots, has_state, dtype, gen):
    """One decode step of new tokens for rows on slots through the kernels (on states: conv, recurrent) and the
    torch path (on ref_states); their outputs equal. has_state None: the kernels get none, the torch path all True."""
    mixed, g, beta = make_tokens(slots.shape[0], dtype, gen)
    flags = None if has_state is None else has_state.to(DEVICE)
    o = triton_gated_delta_decode(mixed, g, beta, weight, *states, slots, HK, flags)
    going = torch.ones(slots.shape[0], dtype=torch.bool) if has_state is None else has_state
    torch.testing.assert_close(o, ref_decode(mixed, g, beta, weight, *ref_states, slots, going), **TOL[dtype])


def prefill_both(weight, states, ref_states, slots, lens, has_state, dtype, gen):
    """Sequences of lens new tokens on slots through the kernels (on states) and the torch path (on ref_states);
    their outputs equal."""
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    mixed, g, beta = make_tokens(cu[-1], dtype, gen)
    o = triton_chunk_gated_delta_rule(mixed, g, beta, weight, *states, slots, cu, HK, has_state.to(DEVICE))
    torch.testing.assert_close(o, ref_prefill(mixed, g, beta, weight, *ref_states, slots, cu, has_state),
                               **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_steps_match_the_torch_path(dtype):
    gen = torch.Generator().manual_seed(1)
    weight, conv, rec = make_states(dtype, gen)
    ref_conv, ref_rec = conv.clone(), rec.clone()
    for step in range(4):
        others = (torch.randperm(SLOTS - 1, generator=gen) + 1)[:2]
        slots = torch.cat([torch.tensor([0]), others])[torch.randperm(3, generator=gen)].to(DEVICE)
        has_state = torch.tensor([True, step % 2 == 0, step != 1])[torch.randperm(3, generator=gen)]
        has_state = torch.where(slots.cpu() == 0, True, has_state)  # slot 0 carries its state through the steps
        for c, r in ((conv, rec), (ref_conv, ref_rec)):
            hide_unread_slots(c, r, slots, has_state)
        decode_both(weight, (conv, rec), (ref_conv, ref_rec), slots, has_state, dtype, gen)
        same_states(conv, rec, ref_conv, ref_rec, dtype)


def test_decode_without_flags_continues_every_slot():
    gen = torch.Generator().manual_seed(2)
    weight, conv, rec = make_states(torch.float32, gen)
    ref_conv, ref_rec = conv.clone(), rec.clone()
    decode_both(weight, (conv, rec), (ref_conv, ref_rec), torch.tensor([5, 2], device=DEVICE), None, torch.float32,
                gen)
    same_states(conv, rec, ref_conv, ref_rec, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [(130, 1, 63), (64, 2)])
def test_prefill_matches_the_torch_path(dtype, lens):
    gen = torch.Generator().manual_seed(sum(lens))
    weight, conv, rec = make_states(dtype, gen)
    slots = torch.randperm(SLOTS, generator=gen)[:len(lens)].to(DEVICE)
    has_state = torch.ones(len(lens), dtype=torch.bool)
    has_state[-1] = False
    hide_unread_slots(conv, rec, slots, has_state)
    ref_conv, ref_rec = conv.clone(), rec.clone()
    prefill_both(weight, (conv, rec), (ref_conv, ref_rec), slots, lens, has_state, dtype, gen)
    same_states(conv, rec, ref_conv, ref_rec, dtype)


def test_prefill_then_decode_continue_one_another():
    """A prompt's prefill from position 0, then decode steps on its slot, equal the torch path over the same
    tokens."""
    gen = torch.Generator().manual_seed(3)
    weight, conv, rec = make_states(torch.float32, gen)
    ref_conv, ref_rec = conv.clone(), rec.clone()
    slots = torch.tensor([4], device=DEVICE)
    prefill_both(weight, (conv, rec), (ref_conv, ref_rec), slots, (70,), torch.tensor([False]), torch.float32, gen)
    for _ in range(3):
        decode_both(weight, (conv, rec), (ref_conv, ref_rec), slots, None, torch.float32, gen)
    same_states(conv, rec, ref_conv, ref_rec, torch.float32)


def test_inputs_that_do_not_fit_are_refused():
    gen = torch.Generator().manual_seed(4)
    weight, conv, rec = make_states(torch.float32, gen)
    mixed, g, beta = make_tokens(2, torch.float32, gen)
    slots = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(ValueError, match="mixed"):
        triton_gated_delta_decode(mixed[:, 1:], g, beta, weight, conv, rec, slots, HK)
    with pytest.raises(ValueError, match="key heads"):
        triton_gated_delta_decode(mixed, g, beta, weight, conv, rec, slots, 3)
    with pytest.raises(ValueError, match="slots"):
        triton_gated_delta_decode(mixed, g, beta, weight, conv, rec, slots[:1], HK)
    with pytest.raises(ValueError, match="cu_seqlens"):
        triton_chunk_gated_delta_rule(mixed, g, beta, weight, conv, rec, slots, [0, 3], HK)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs: on the GPU only")
def test_decode_replays_in_a_cuda_graph_with_new_slots():
    """The step captured once, then replayed with other slots and flags written into its inputs, equals the torch
    path each time."""
    gen = torch.Generator().manual_seed(5)
    dtype = torch.bfloat16
    weight, conv, rec = make_states(dtype, gen)
    mixed, g, beta = (t.clone() for t in make_tokens(3, dtype, gen))
    slots = torch.tensor([0, 1, 2], device=DEVICE)
    has_state = torch.ones(3, dtype=torch.bool, device=DEVICE)
    scratch_conv, scratch_rec = conv.clone(), rec.clone()
    triton_gated_delta_decode(mixed, g, beta, weight, scratch_conv, scratch_rec, slots, HK, has_state)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = triton_gated_delta_decode(mixed, g, beta, weight, conv, rec, slots, HK, has_state)
    ref_conv, ref_rec = conv.clone(), rec.clone()
    for step in range(3):
        new_slots = torch.randperm(SLOTS, generator=gen)[:3]
        new_flags = torch.tensor([True, step != 1, True])
        hide_unread_slots(conv, rec, new_slots, new_flags)
        hide_unread_slots(ref_conv, ref_rec, new_slots, new_flags)
        for buf, new in zip((mixed, g, beta), make_tokens(3, dtype, gen)):
            buf.copy_(new)
        slots.copy_(new_slots)
        has_state.copy_(new_flags)
        graph.replay()
        ref = ref_decode(mixed, g, beta, weight, ref_conv, ref_rec, new_slots.to(DEVICE), new_flags)
        torch.testing.assert_close(o, ref, **TOL[dtype])
        same_states(conv, rec, ref_conv, ref_rec, dtype)
