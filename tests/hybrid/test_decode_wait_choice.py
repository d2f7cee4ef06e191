"""HybridExperts.decode_wait "auto": the decode thread naps (and the handoffs' pools take every CPU) when a
token's CPU experts read at least NAP_BYTES per MoE layer, else it spins on a CPU of its own. Real packed
CpuExperts; the bytes are their packed buffers'."""

import pytest
import torch

from hybridmoe import CpuExperts
from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.hybrid import NAP_BYTES, cpu_bytes_per_token, resolve_decode_wait

H, I = 256, 128


def cpu_experts(n, fmt="bf16"):
    g = torch.Generator().manual_seed(0)
    w = [torch.randn(n, I, H, generator=g), torch.randn(n, I, H, generator=g), torch.randn(n, H, I, generator=g)]
    return CpuExperts(*w, format=fmt, group_size=32, threads=1)


def test_bytes_per_token_are_top_k_times_the_cpu_share_of_an_experts_bytes():
    six, two = cpu_experts(6), cpu_experts(2, "int4")
    per_expert = six.packed_bytes / 6
    assert per_expert == 3 * H * I * 2  # bf16: gate, up, down
    # 8 experts, top 4: 6 of 8 on the CPU read 3 experts' worth per token; a layer all on the GPU does not count
    assert cpu_bytes_per_token([(8, 4, six), (8, 4, None)]) == pytest.approx(3 * per_expert)
    mean = (3 * per_expert + 4 * 2 / 8 * two.packed_bytes / 2) / 2
    assert cpu_bytes_per_token([(8, 4, six), (8, 4, two)]) == pytest.approx(mean)
    assert cpu_bytes_per_token([]) == 0.0


def test_auto_naps_at_the_threshold_and_spins_below_it():
    ex = cpu_experts(4)  # all 4 experts on the CPU: a token reads top_k experts' bytes
    per_expert = ex.packed_bytes / 4
    at = -(-NAP_BYTES // per_expert)  # the least top_k that reads NAP_BYTES
    assert resolve_decode_wait("auto", [(4, 4, ex)]) == "spin"  # a toy layer reads far less
    assert resolve_decode_wait("auto", [(4, at - 1, ex)]) == "spin"
    assert resolve_decode_wait("auto", [(4, at, ex)]) == "nap"


@pytest.mark.parametrize("mode", ["spin", "nap", "block"])
def test_an_explicit_mode_is_kept(mode):
    assert resolve_decode_wait(mode, [(4, 4, cpu_experts(4))]) == mode


def test_an_unknown_mode_is_refused():
    with pytest.raises(HybridMoEError, match="decode_wait must be one of auto, spin, nap, block"):
        resolve_decode_wait("sleepy", [])
