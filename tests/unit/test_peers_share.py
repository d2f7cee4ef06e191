import pytest

from benchmarks.lib.peers_compare import llama_floor_tok_s
from benchmarks.lib.peers_share import llama_gpu_share, ncmoe_for_share
from hybridmoe.errors import HybridMoEError

QWEN_8 = list(range(8))  # 8 blocks, every one MoE
DEEPSEEK_8 = list(range(1, 8))  # block 0 dense


@pytest.mark.parametrize(("moe", "share", "ncmoe"), [
    (QWEN_8, 0.0, 8), (QWEN_8, 1.0, 0), (QWEN_8, 0.5, 4), (QWEN_8, 0.6, 3), (QWEN_8, 0.26, 6),
    (DEEPSEEK_8, 0.0, 8), (DEEPSEEK_8, 1.0, 0), (DEEPSEEK_8, 3 / 7, 5),
])
def test_ncmoe_leaves_the_nearest_share_of_moe_layers_on_the_gpu(moe, share, ncmoe):
    assert ncmoe_for_share(8, moe, share) == ncmoe
    gpu = [layer for layer in moe if layer >= ncmoe]
    assert abs(len(gpu) / len(moe) - share) <= 0.5 / len(moe) + 1e-9


def test_a_tie_keeps_the_layer_on_the_cpu():
    assert ncmoe_for_share(4, list(range(4)), 0.375) == 3  # 1.5 of 4 layers -> 1 on the GPU


def test_a_share_outside_0_to_1_is_an_error():
    with pytest.raises(HybridMoEError, match="between 0 and 1"):
        ncmoe_for_share(8, QWEN_8, 1.5)


def test_llama_share_and_floor_count_the_expert_bytes_of_each_side_of_ncmoe():
    exps = {0: 100, 1: 100, 2: 300, 3: 500}  # block -> its stacked experts' bytes (mixed types per layer)
    assert llama_gpu_share(exps, 2) == pytest.approx(0.8)
    assert llama_gpu_share(exps, 4) == 0.0
    # 4 experts per token of 10 per layer, blocks 0 and 1 on the CPU: 4 * (10 + 10) bytes per token
    assert llama_floor_tok_s(exps, 2, num_experts=10, top_k=4, bandwidth=800.0) == pytest.approx(10.0)
    assert llama_floor_tok_s(exps, 0, num_experts=10, top_k=4, bandwidth=800.0) is None
