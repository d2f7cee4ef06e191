"""DeepSeek GGUF files (general.architecture deepseek2), written here as llama.cpp converts a DeepseekV2 or V3
checkpoint, in mixed tensor types (F32, F16, BF16, Q8_0, Q4_0, Q4_1 and K-quants), load and compute what
transformers computes with the weights the file decodes to.

V3: sigmoid routing with the correction bias, grouped top-k, q_lora_rank, YaRN, kv_b_proj split into
attn_k_b + attn_v_b (newer conversions). V2: softmax group-limited routing, no q_lora_rank (attn_q), the whole
attn_kv_b and per-head key/value lengths, no expert_gating_func key (older conversions).
"""

import json

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_writer import randomize, write_deepseek_gguf
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from hybridmoe.checkpoint.presets import model_config
from hybridmoe.checkpoint.tokenizer import write_tokenizer
from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.forward_context import Context, use_context
from hybridmoe.weights.safetensors import SafetensorsCheckpoint

PROMPT = [5, 17, 3, 60, 22, 9, 41, 300, 2, 77, 101]
# K-quants need rows of 256: the hidden size is 256; the narrower tensors take 32-wide block types
SHAPE = dict(vocab_size=512, hidden_size=256, intermediate_size=256, moe_intermediate_size=32, kv_lora_rank=32,
             qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=3,
             n_group=4, topk_group=2, num_hidden_layers=3, first_k_dense_replace=1, max_position_embeddings=512)
CASES = {
    "v3-split-kv-b": ("deepseek_v3", dict(q_lora_rank=32), True),
    "v2-no-q-lora-whole-kv-b": ("deepseek_v2", dict(q_lora_rank=None, n_shared_experts=1), False),
}
# Q4_K_M-like: a type per kind of tensor (first match wins); norms, router and its bias stay F32
TYPES = {"embed_tokens": Q.BF16, "lm_head": Q.Q6_K, "q_a_proj": Q.Q6_K, "q_b_proj": Q.Q8_0, "q_proj": Q.Q4_K,
         "kv_a_proj": Q.Q5_K, "k_b_proj": Q.F16, "v_b_proj": Q.Q8_0, "kv_b_proj": Q.Q8_0, "o_proj": Q.Q4_0,
         "shared_experts.gate": Q.Q5_K, "shared_experts.up": Q.Q6_K, "shared_experts.down": Q.Q4_1,
         "experts.gate": Q.Q4_K, "experts.up": Q.Q3_K, "experts.down": Q.Q8_0,
         "mlp.gate_proj": Q.Q4_K, "mlp.up_proj": Q.Q2_K, "mlp.down_proj": Q.Q8_0}


def tensor_type(name: str) -> Q:
    return next((qtype for key, qtype in TYPES.items() if key in name), Q.F32)


def write_case(tmp, arch: str, overrides: dict, split_kv_b: bool):
    """(GGUF path, transformers model on the weights that file decodes to)."""
    config = {**model_config(arch, "tiny", dtype="fp32"), **SHAPE, **overrides}
    hf_config = AutoConfig.for_model(config.pop("model_type"), **config)
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    randomize(hf)
    hf.save_pretrained(tmp / "hf")  # per-expert HF names, as checkpoints (and llama.cpp's converter) have them
    with SafetensorsCheckpoint(tmp / "hf") as ckpt:
        tensors = {n: ckpt.get(n) for n in ckpt.weight_names()}
    write_tokenizer(tmp, arch, SHAPE["vocab_size"])
    saved = hf_config.to_dict()
    decoded = write_deepseek_gguf(tensors, saved, tmp, tmp / "model.gguf", tensor_type, split_kv_b)
    (tmp / "ref").mkdir()
    save_file(decoded, tmp / "ref" / "model.safetensors", metadata={"format": "pt"})
    (tmp / "ref" / "config.json").write_text(json.dumps(saved))
    return tmp / "model.gguf", AutoModelForCausalLM.from_pretrained(tmp / "ref", dtype=torch.float32).eval()


@torch.no_grad()
def our_logits(model):
    model.allocate_kv_cache(1, 32)
    with use_context(Context(slot_ids=[0], start_pos=[0], cu_seqlens=[0, len(PROMPT)])):
        return model.compute_logits(model(torch.tensor(PROMPT), torch.arange(len(PROMPT))))


@pytest.mark.parametrize("case", CASES)
def test_deepseek_gguf_logits_equal_transformers_on_the_decoded_weights(case, tmp_path):
    arch, overrides, split_kv_b = CASES[case]
    path, reference = write_case(tmp_path, arch, overrides, split_kv_b)
    with torch.no_grad():
        want = reference(torch.tensor([PROMPT])).logits[0]
    loaded = load_model(path, EngineConfig(dtype="float32", cache_dir=str(tmp_path / "cache")))
    c = loaded.config
    assert type(loaded.model).__name__ == type(reference).__name__
    assert (c.q_lora_rank, c.qk_nope_head_dim, c.v_head_dim, c.n_group) == (overrides["q_lora_rank"], 16, 32, 4)
    assert loaded.model.moe_layers == [1, 2]
    # the random K-quant blocks make logits of up to ~100: float32 sums in another order differ by ~1e-5 of that
    torch.testing.assert_close(our_logits(loaded.model), want, atol=1e-5 * float(want.abs().max()), rtol=1e-4)
