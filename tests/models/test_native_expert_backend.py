"""expert_backend="native" plugs the C++ CPU engine in under the same model: same logits as the torch reference."""

import torch
from compare import assert_close, run_step
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model


def test_native_bf16_experts_give_the_torch_reference_logits(tmp_path):
    torch.manual_seed(0)
    config = Qwen2MoeConfig(vocab_size=64, hidden_size=64, intermediate_size=48, moe_intermediate_size=32,
                            shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, num_experts=8, num_experts_per_tok=2)
    Qwen2MoeForCausalLM(config).save_pretrained(tmp_path)
    reference = load_model(tmp_path).model
    native = load_model(tmp_path, EngineConfig(expert_backend="native", expert_format="bf16", cpu_threads=1))
    assert native.experts.layers() == [0, 1]
    prompts = [[5, 17, 3, 60, 22, 9, 41], [7, 2, 33]]
    for model in (reference, native.model):
        model.allocate_kv_cache(2, 16)
    want = run_step(reference, prompts, slots=[0, 1], start_pos=[0, 0])
    got = run_step(native.model, prompts, slots=[0, 1], start_pos=[0, 0])
    for g, w in zip(got, want):
        # the engine computes in bf16: compare with the bf16 row of the tolerance table
        assert_close(g, w, dtype=torch.bfloat16, what="native vs torch experts")
    decode_want = run_step(reference, [[1], [2]], slots=[0, 1], start_pos=[7, 3])
    decode_got = run_step(native.model, [[1], [2]], slots=[0, 1], start_pos=[7, 3])
    for g, w in zip(decode_got, decode_want):
        assert_close(g, w, dtype=torch.bfloat16, what="native vs torch experts, decode")
