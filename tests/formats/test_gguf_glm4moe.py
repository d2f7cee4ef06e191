"""GLM-4.5 GGUF files (general.architecture glm4moe), written here as llama.cpp's converter writes a
Glm4MoeForCausalLM checkpoint, load and compute what transformers computes with the weights the file decodes to.

The cases cover q/k norm on and off, half of each head rotating, the best group of 2 (and no groups), a dense first
layer, a shared expert, q/k/v bias, the multi-token-prediction layer past the last decoder layer (which loading
skips) and a file converted without it; tensors in F32 (the checkpoint's own values), F16 and Q8_0, the routers
and vectors in F32 as the converter keeps them.
"""

import json

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_writer import GLM_ROLES, randomize, write_glm4moe_gguf
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, Glm4MoeConfig, Glm4MoeForCausalLM

from hybridmoe import LLM
from hybridmoe.checkpoint.tokenizer import write_tokenizer
from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.errors import CheckpointError
from hybridmoe.forward_context import Context, use_context
from hybridmoe.sampling_params import SamplingParams
from hybridmoe.weights.gguf_model_dir import resolve_model_path
from hybridmoe.weights.gguf_tokenizer import tokenizer_files
from hybridmoe.weights.safetensors import SafetensorsCheckpoint

PROMPT = [5, 17, 3, 60, 22, 9, 41, 300, 2, 77, 101]
LAYERS = 3
# Q8_0 blocks are 32 wide: every width is a multiple of 32
SHAPE = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "n_routed_experts": 8,
         "n_shared_experts": 1, "num_experts_per_tok": 3, "first_k_dense_replace": 1, "norm_topk_prob": True,
         "routed_scaling_factor": 2.5, "attention_bias": True, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}
GROUPS = {"n_group": 2, "topk_group": 1}
CASES = {
    # (config overrides, type of the matrices, multi-token-prediction layers in the file)
    "f32-qk-norm-two-groups-mtp": ({"use_qk_norm": True, **GROUPS}, Q.F32, 1),
    "f16-no-qk-norm-no-groups-no-mtp": ({"use_qk_norm": False, "n_group": 1, "topk_group": 1, "norm_topk_prob": False},
                                        Q.F16, 0),
    "q8_0-qk-norm-two-groups-mtp": ({"use_qk_norm": True, **GROUPS}, Q.Q8_0, 1),
}
MTP_ONLY = {"eh_proj.weight": (64, 128), "enorm.weight": (64,), "hnorm.weight": (64,),
            "shared_head.norm.weight": (64,)}
"""The multi-token-prediction layer's own tensors (beside a decoder layer's), as GLM-4.5 checkpoints have them."""


def tensor_types(qtype: Q):
    """The converter's choice: vectors and routers F32, the other matrices qtype."""
    def pick(name: str) -> Q:
        vector = name.endswith(("norm.weight", ".bias", "e_score_correction_bias"))
        return Q.F32 if vector or name.endswith("mlp.gate.weight") else qtype
    return pick


def write_case(tmp, overrides: dict, qtype: Q, nextn: int, omit: tuple[str, ...] = ()):
    """(GGUF path, the checkpoint's tensors, what the file decodes to), of a random GLM-4.5 of LAYERS layers plus
    nextn multi-token-prediction layers."""
    config = Glm4MoeConfig(**{**SHAPE, **overrides, "num_hidden_layers": LAYERS + nextn})
    torch.manual_seed(0)
    hf = Glm4MoeForCausalLM(config).float().eval()
    randomize(hf)
    hf.save_pretrained(tmp / "hf")  # per-expert HF names, as checkpoints (and llama.cpp's converter) have them
    with SafetensorsCheckpoint(tmp / "hf") as ckpt:
        tensors = {n: ckpt.get(n) for n in ckpt.weight_names()}
    gen = torch.Generator().manual_seed(1)
    for layer in range(LAYERS, LAYERS + nextn):
        tensors.update({f"model.layers.{layer}.{n}": torch.randn(s, generator=gen) for n, s in MTP_ONLY.items()})
    write_tokenizer(tmp, "glm4_moe", SHAPE["vocab_size"])
    saved = {**config.to_dict(), "num_hidden_layers": LAYERS}
    decoded = write_glm4moe_gguf(tensors, saved, tmp, tmp / "model.gguf", tensor_types(qtype), nextn=nextn,
                                 omit=omit)
    return tmp / "model.gguf", tensors, decoded, saved


def reference(tmp, decoded: dict, saved: dict):
    """transformers' Glm4MoeForCausalLM of the decoder layers' decoded weights, every one of them used."""
    trunk = {n: t for n, t in decoded.items() if not n.startswith(f"model.layers.{LAYERS}.")}
    (tmp / "ref").mkdir()
    save_file(trunk, tmp / "ref" / "model.safetensors", metadata={"format": "pt"})
    (tmp / "ref" / "config.json").write_text(json.dumps(saved))
    model, info = AutoModelForCausalLM.from_pretrained(tmp / "ref", dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    return model.eval()


@pytest.fixture(scope="module", params=CASES)
def written(request, tmp_path_factory):
    overrides, qtype, nextn = CASES[request.param]
    tmp = tmp_path_factory.mktemp("glm4moe")
    path, tensors, decoded, saved = write_case(tmp, overrides, qtype, nextn)
    if qtype == Q.F32:  # the file holds the checkpoint's own values
        assert all(torch.equal(decoded[n], t.float()) for n, t in tensors.items())
    return request.param, path, reference(tmp, decoded, saved)


@torch.no_grad()
def our_logits(model):
    model.allocate_kv_cache(1, 32)
    with use_context(Context(slot_ids=[0], start_pos=[0], cu_seqlens=[0, len(PROMPT)])):
        return model.compute_logits(model(torch.tensor(PROMPT), torch.arange(len(PROMPT))))


def test_glm4moe_gguf_logits_equal_transformers_on_the_decoded_weights(written, tmp_path):
    case, path, ref = written
    overrides, _, _ = CASES[case]
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0]
    loaded = load_model(path, EngineConfig(dtype="float32", cache_dir=str(tmp_path)))
    c = loaded.config
    assert type(loaded.model).__name__ == "Glm4MoeForCausalLM"
    assert (c.num_hidden_layers, c.n_group, c.topk_group, c.use_qk_norm, c.attention_bias, c.n_shared_experts,
            c.routed_scaling_factor) == (LAYERS, overrides["n_group"], overrides["topk_group"],
                                         overrides["use_qk_norm"], True, 1, 2.5)
    assert loaded.model.model.layers[0].self_attn.rotary.dim == 16
    assert loaded.model.moe_layers == [1, 2]
    torch.testing.assert_close(our_logits(loaded.model), want, atol=1e-4, rtol=1e-4)


def test_glm4moe_gguf_greedy_tokens_match_transformers(written, tmp_path):
    _, path, ref = written
    llm = LLM(path, dtype="float32", cache_dir=str(tmp_path))
    ids = llm.encode("The capital of France is")
    with torch.no_grad():
        hf = ref.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    out = llm.generate(ids, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == hf[0, len(ids):].tolist()


def test_glm4moe_gguf_tokenizer_splits_digits_by_three_adds_no_bos_and_stops_at_every_end_token(written, tmp_path):
    _, path, _ = written
    model_dir = resolve_model_path(path, EngineConfig(cache_dir=str(tmp_path)))
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert [w for w, _ in tok.pre_tokenizer.pre_tokenize_str("ab 12345")] == ["ab", "\u0120", "123", "45"]
    gmask = tok.token_to_id(GLM_ROLES["bos"])
    assert gmask not in tok.encode("hello").ids
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tok.token_to_id(GLM_ROLES[r]) for r in ("eos", "eot", "eom")]


def test_glm4_vocabulary_adds_no_bos_even_when_the_file_asks():
    """llama.cpp drops a GLM-4 vocabulary's BOS ([gMASK], which the chat template writes itself)."""
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "glm4", "tokenizer.ggml.tokens": ["a", "[gMASK]"],
            "tokenizer.ggml.token_type": [1, 3], "tokenizer.ggml.merges": [], "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.add_bos_token": True}
    tok, config = tokenizer_files(meta)
    assert tok.encode("a").ids == [0] and config["add_bos_token"] is False


@pytest.mark.parametrize("key, overrides", [("expert_shared_count", {}), ("expert_feed_forward_length", {}),
                                            ("expert_group_used_count", GROUPS)])
def test_glm4moe_gguf_without_a_required_key_is_an_error(key, overrides, tmp_path):
    path, *_ = write_case(tmp_path, {"use_qk_norm": True, **overrides}, Q.F32, 0, omit=(key,))
    with pytest.raises(CheckpointError, match=f"lacks the metadata key glm4moe.{key}"):
        resolve_model_path(path, EngineConfig(cache_dir=""))
