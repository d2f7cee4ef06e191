"""Models decoding with the layer fusions (fused_layer, on by default: the Triton decode GEMV for qkv_proj with
the input norm, o_proj, the router with the residual add + post-attention norm; rotary inside decode attention;
MLA's decode in one kernel) against the same models without them, graph-replayed, batch 1 and 4. Qwen3 (q/k
norms), Qwen2 (q/k/v bias, shared expert), Mixtral, DeepSeek V2 (MLA, softmax router) and V3 (sigmoid router,
float32 logits); float32 and bfloat16. The model with them decodes the greedy tokens of the model without them
and its logprobs are held to those step by step (logprobs_close.py): in bfloat16 the two differ by an ulp here
and there (other kernels, other summation orders), which flips near-tied experts of the tiny DeepSeeks (their
routing is near-tied everywhere); such steps are excused by their routing margin, not compared. The kernels'
results are held to torch in test_mla_decode_triton.py and test_gemv_triton.py. Runs on the GPU host through
scripts/device_check.sh.
"""

import pytest
import torch
from test_cuda_graph import HYBRID, assert_close_to, runs

from hybridmoe import LLM
from hybridmoe.checkpoint.make import make_checkpoint
from hybridmoe.models.base import DecoderLayer

pytestmark = [pytest.mark.device,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def decoder(checkpoint, layer: bool) -> LLM:
    llm = LLM(checkpoint, device="cuda", **HYBRID)
    model = llm.engine.runner.model
    model.fuse_decode_kernels(True, layer=layer)
    assert all(m.fused_layer == layer for m in model.modules() if isinstance(m, DecoderLayer))
    return llm


@pytest.mark.parametrize("arch,dtype", [("qwen3_moe", "fp32"), ("qwen3_moe", "bf16"), ("qwen2_moe", "bf16"),
                                        ("mixtral", "bf16"), ("deepseek_v2", "fp32"), ("deepseek_v2", "bf16"),
                                        ("deepseek_v3", "fp32"), ("deepseek_v3", "bf16")])
def test_model_decodes_with_the_decode_gemv_as_without(tmp_path, arch, dtype):
    make_checkpoint(arch, "tiny", tmp_path, dtype=dtype, seed=1, progress=False)
    reference, fused = decoder(tmp_path, False), decoder(tmp_path, True)
    assert_close_to(fused, reference, runs(reference))
    assert fused.engine.runner.captured == reference.engine.runner.captured == [(1, 64), (4, 64)]
