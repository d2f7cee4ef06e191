"""A GGUF file of mixed tensor types (F32, F16, BF16, Q8_0, Q4_0, Q4_1 and the K-quants Q2_K..Q6_K) loads
and computes what transformers computes with the weights the file decodes to."""

import json

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_writer import save_tiny_qwen3, write_qwen3_gguf
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from hybridmoe import LLM
from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.forward_context import Context, use_context
from hybridmoe.sampling_params import SamplingParams

PROMPT = [5, 17, 3, 60, 22, 9, 41, 300, 2]
# K-quants need rows of 256: every width of this model is 256
CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=256, moe_intermediate_size=256,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=4,
              num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512, rope_theta=1e6,
              rms_norm_eps=1e-6, tie_word_embeddings=False)

TYPES = {"embed_tokens": Q.BF16, "lm_head": Q.Q6_K, "q_proj": Q.Q8_0, "k_proj": Q.Q4_0, "v_proj": Q.Q4_1,
         "o_proj": Q.F16, "mlp.gate.": Q.Q2_K, "gate_proj": Q.Q4_K, "up_proj": Q.Q5_K,
         "layers.0.mlp.experts.down_proj": Q.Q6_K, "layers.1.mlp.experts.down_proj": Q.Q3_K}


def tensor_type(name: str) -> Q:
    """Q4_K_M-like: a different type per kind of tensor; norms stay F32."""
    for key, qtype in TYPES.items():
        if key in name:
            return qtype
    return Q.F32


@pytest.fixture(scope="module")
def gguf_and_reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gguf")
    tensors, config = save_tiny_qwen3(tmp, CONFIG)
    decoded = write_qwen3_gguf(tensors, {**CONFIG, **config}, tmp, tmp / "model.gguf", tensor_type)
    (tmp / "ref").mkdir()
    save_file(decoded, tmp / "ref" / "model.safetensors", metadata={"format": "pt"})
    (tmp / "ref" / "config.json").write_text(json.dumps(config))
    reference = AutoModelForCausalLM.from_pretrained(tmp / "ref", dtype=torch.float32).eval()
    return tmp / "model.gguf", reference, tmp


@torch.no_grad()
def our_logits(model):
    model.allocate_kv_cache(1, 32)
    with use_context(Context(slot_ids=[0], start_pos=[0], cu_seqlens=[0, len(PROMPT)])):
        return model.compute_logits(model(torch.tensor(PROMPT), torch.arange(len(PROMPT))))


def test_gguf_logits_equal_transformers_on_the_decoded_weights(gguf_and_reference, tmp_path):
    path, reference, _ = gguf_and_reference
    with torch.no_grad():
        want = reference(torch.tensor([PROMPT])).logits[0]
    loaded = load_model(path, EngineConfig(dtype="float32", cache_dir=str(tmp_path)))
    assert loaded.config.num_experts == 4 and loaded.config.head_dim == 64
    torch.testing.assert_close(our_logits(loaded.model), want, atol=1e-4, rtol=1e-4)


def test_gguf_greedy_text_generation_matches_transformers(gguf_and_reference, tmp_path):
    path, reference, tok_dir = gguf_and_reference
    llm = LLM(path, dtype="float32", cache_dir=str(tmp_path))
    prompt = "The capital of France is"
    ids = llm.encode(prompt)
    with torch.no_grad():
        hf = reference.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    out = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == hf[0, len(ids):].tolist()


def test_native_int4_experts_from_gguf_pack_like_the_decoded_safetensors(gguf_and_reference, tmp_path):
    path, _, tmp = gguf_and_reference
    options = dict(dtype="float32", expert_backend="native", expert_format="int4", expert_group_size=32,
                   cpu_threads=1, cache_dir="")
    from_gguf = our_logits(load_model(path, EngineConfig(**options)).model)
    from_safetensors = our_logits(load_model(tmp / "ref", EngineConfig(**options)).model)
    # GGUF experts reach the engine as float (dequantized, then packed to int4): the same bits as the decoded weights
    torch.testing.assert_close(from_gguf, from_safetensors, atol=0, rtol=0)
