"""Decoding token by token from the KV cache gives the logits of recomputing the whole sequence."""

import pytest
import torch
from compare import assert_close, run_step

from hybridmoe import LLM
from hybridmoe.checkpoint.make import make_checkpoint
from hybridmoe.models.registry import ARCHITECTURES

FAMILIES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
            "mixtral": "MixtralForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
            "deepseek_v3": "DeepseekV3ForCausalLM"}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_cached_decode_logits_equal_full_recomputation(family, tmp_path):
    pytest.importorskip(ARCHITECTURES[FAMILIES[family]][0])
    make_checkpoint(family, "tiny", tmp_path, dtype="fp32", progress=False)
    llm = LLM(tmp_path, dtype="float32", max_num_seqs=2)
    model = llm.engine.runner.model
    model.allocate_kv_cache(2, 64, block_size=16)  # contiguous slots of 4 blocks: 0 decodes, 1 recomputes
    ids = llm.tokenizer.encode("Once upon a time, there was")
    (logits,) = run_step(model, [ids], slots=[0], start_pos=[0])
    for _ in range(8):
        ids.append(int(logits[-1].argmax()))
        (logits,) = run_step(model, [ids[-1:]], slots=[0], start_pos=[len(ids) - 1])  # [1, V]
        (full,) = run_step(model, [ids], slots=[1], start_pos=[0])  # [len(ids), V]
        assert_close(logits[-1], full[-1], torch.float32, f"{family} position {len(ids) - 1}")
