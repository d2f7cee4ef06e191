"""Models decoding with the layer fusions (fused_layer: the Triton decode GEMV for qkv_proj with the input
norm, o_proj, the router with the residual add + post-attention norm; rotary inside decode attention; MLA's
decode in one kernel) against the same models without them, graph-replayed, batch 1 and 4. Qwen3 (q/k
norms), Qwen2 (q/k/v bias, shared expert), Mixtral, DeepSeek V2 (MLA, softmax router) and V3 (sigmoid
router, float32 logits); float32 and bfloat16. DeepSeek only in float32: in bfloat16 the two sides differ
by an ulp here and there (other kernels, other summation orders), which flips near-tied experts, and the
tiny V2's routed_scaling_factor of 16 turns one flipped expert into another token (seen on the H200);
the kernels' bfloat16 results are held to torch in test_mla_decode_triton.py and test_gemv_triton.py.
Runs on the GPU host through scripts/device_check.sh.
"""

import pytest
import torch

from hybridmoe import LLM
from hybridmoe.checkpoint.make import make_checkpoint
from hybridmoe.models.base import DecoderLayer

from test_cuda_graph import HYBRID, assert_greedy_close, runs

pytestmark = [pytest.mark.device,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def decode(checkpoint, layer: bool) -> list[tuple[list[int], list]]:
    llm = LLM(checkpoint, device="cuda", **HYBRID)
    model = llm.engine.runner.model
    model.fuse_decode_kernels(True, layer=layer)
    assert all(m.fused_layer == layer for m in model.modules() if isinstance(m, DecoderLayer))
    out = runs(llm)
    assert llm.engine.runner.captured == [(1, 64), (4, 64)]
    return out


@pytest.mark.parametrize("arch,dtype", [("qwen3_moe", "fp32"), ("qwen3_moe", "bf16"), ("qwen2_moe", "bf16"),
                                        ("mixtral", "bf16"), ("deepseek_v2", "fp32"), ("deepseek_v3", "fp32")])
def test_model_decodes_with_the_decode_gemv_as_without(tmp_path, arch, dtype):
    """The same greedy tokens, except that the two may part at a near-tie (each side's token among the
    other's 5 most likely; not compared after it)."""
    make_checkpoint(arch, "tiny", tmp_path, dtype=dtype, seed=1, progress=False)
    assert_greedy_close(decode(tmp_path, True), decode(tmp_path, False))
