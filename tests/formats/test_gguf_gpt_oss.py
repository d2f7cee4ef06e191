"""gpt-oss GGUF files (general.architecture gpt-oss), written here as llama.cpp's converter writes a
GptOssForCausalLM checkpoint, load and compute what transformers computes.

The model is a tiny random gpt-oss in float32, every weight redrawn at O(1) scale (the biases and the attention
sinks too), with a window of 8 positions under a 40-token prompt. Its experts are stored in F32 (the checkpoint's
own values: the logits equal transformers' at float32 tolerance) and in MXFP4 (quantized by gguf.quants; the
reference is transformers with each expert set to this file's own decoding of the same blocks, written from ggml's
block format). Also: MXFP4 blocks decode bit for bit as ggml lays them out, over every byte value in every position
and scales from the smallest to the overflowing; llama.cpp's sliding-window pattern keys; the o200k pre-tokenizer
and harmony's stop tokens; a missing required key.
"""

import json

import numpy as np
import pytest
import regex
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf_writer import finish, randomize, write_gpt_oss_gguf
from tiktoken_ext import openai_public
from tokenizers import Tokenizer
from transformers import GptOssConfig, GptOssForCausalLM

from hybridmoe import LLM
from hybridmoe.checkpoint.tokenizer import write_tokenizer
from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.errors import CheckpointError
from hybridmoe.forward_context import Context, use_context
from hybridmoe.sampling_params import SamplingParams
from hybridmoe.server.tool_parsers import parser_for_template
from hybridmoe.tokenizer import Tokenizer as HybridTokenizer
from hybridmoe.weights.gguf_checkpoint import GGUFCheckpoint
from hybridmoe.weights.gguf_file import GGUFFiles
from hybridmoe.weights.gguf_model_dir import resolve_model_path
from hybridmoe.weights.native_format import source_expert_format

PROMPT = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(7)).tolist()
TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 8,
        "num_experts_per_tok": 3, "sliding_window": 8, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}
"""Widths are whole MXFP4 blocks of 32; the clamped SwiGLU keeps llama.cpp's limit 7.0."""
SHORT_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 16.0, "beta_slow": 2.0,
              "truncate": False, "original_max_position_embeddings": 16}
FIRST_FULL = {"rope_parameters": SHORT_YARN, "max_position_embeddings": 128,
              "layer_types": ["full_attention", "sliding_attention", "sliding_attention"]}
CASES = {
    # (expert type, config overrides, further gpt-oss.* keys)
    "f32-released-yarn-even-layers-slide": (Q.F32, {}, {}),
    "mxfp4-short-yarn-pattern-array": (Q.MXFP4, FIRST_FULL, {"attention.sliding_window_pattern": [False, True, True]}),
}
HARMONY_STOPS = ("<|return|>", "<|call|>", "<|endoftext|>")


def e2m1_doubled(code: int) -> int:
    """Twice the value of a 4-bit e2m1 code (sign bit, 2 exponent bits, 1 mantissa bit): exponent 0 is subnormal
    (0 or 0.5), else (1 + m / 2) * 2^(e - 1). ggml keeps these doubled integers, so code 8 (-0) is +0."""
    sign, exp, man = code >> 3, (code >> 1) & 3, code & 1
    doubled = man if exp == 0 else (2 + man) << (exp - 1)
    return -doubled if sign else doubled


def reference_mxfp4(raw: np.ndarray) -> np.ndarray:
    """uint8 [..., n * 17] of ggml's block_mxfp4 -> float32 [..., n * 32].

    A block is one e8m0 byte e, then 16 bytes qs; value j < 16 is qs[j]'s low nibble, value 16 + j its high nibble;
    each is e2m1 * 2^(e - 127) (doubled e2m1 times 2^(e - 128)), exact in float64, rounded once to float32."""
    blocks = raw.reshape(*raw.shape[:-1], -1, 17)
    table = np.array([e2m1_doubled(c) for c in range(16)], np.float64)
    qs = blocks[..., 1:]
    values = np.concatenate((table[qs & 0xF], table[qs >> 4]), axis=-1)
    with np.errstate(over="ignore"):
        out = (values * np.exp2(blocks[..., :1].astype(np.float64) - 128)).astype(np.float32)
    return out.reshape(*raw.shape[:-1], -1)


def tiny_hf(**overrides) -> GptOssForCausalLM:
    torch.manual_seed(0)
    hf = GptOssForCausalLM(GptOssConfig(**{**TINY, **overrides})).float().eval()
    randomize(hf)
    return hf


def write_case(tmp, expert_type: Q, overrides: dict, metadata: dict, omit: tuple[str, ...] = ()):
    """(GGUF path, the transformers model, what each GGUF tensor stores)."""
    hf = tiny_hf(**overrides)
    write_tokenizer(tmp, "gpt_oss", TINY["vocab_size"])
    path = tmp / "model.gguf"
    stored = write_gpt_oss_gguf(dict(hf.state_dict()), hf.config.to_dict(), tmp, path, expert_type, metadata, omit)
    return path, hf, stored


@torch.no_grad()
def set_experts_to_decoded(hf: GptOssForCausalLM, stored: dict) -> None:
    """Each layer's fused experts set to reference_mxfp4's decoding of the file's MXFP4 blocks: gate_up_proj
    [E, H, 2I] interleaves ffn_gate_exps and ffn_up_exps [E, I, H]; down_proj [E, I, H] is ffn_down_exps
    [E, H, I] transposed."""
    for i, layer in enumerate(hf.model.layers):
        gate, up, down = (torch.from_numpy(reference_mxfp4(stored[f"blk.{i}.ffn_{p}_exps.weight"]))
                          for p in ("gate", "up", "down"))
        experts, inter, hidden = gate.shape
        layer.mlp.experts.gate_up_proj.copy_(torch.stack((gate, up), dim=2).reshape(experts, 2 * inter, hidden)
                                             .transpose(1, 2))
        layer.mlp.experts.down_proj.copy_(down.transpose(1, 2))


@pytest.fixture(scope="module", params=CASES)
def written(request, tmp_path_factory):
    expert_type, overrides, metadata = CASES[request.param]
    path, hf, stored = write_case(tmp_path_factory.mktemp("gpt_oss"), expert_type, overrides, metadata)
    if expert_type == Q.MXFP4:
        assert all(stored[f"blk.{i}.ffn_up_exps.weight"].dtype == np.uint8 for i in range(3))
        set_experts_to_decoded(hf, stored)
    return path, hf


@torch.no_grad()
def our_logits(model):
    model.allocate_kv_cache(1, len(PROMPT))
    with use_context(Context(slot_ids=[0], start_pos=[0], cu_seqlens=[0, len(PROMPT)])):
        return model.compute_logits(model(torch.tensor(PROMPT), torch.arange(len(PROMPT))))


def test_gpt_oss_gguf_logits_equal_transformers(written, tmp_path):
    path, hf = written
    loaded = load_model(path, EngineConfig(dtype="float32", cache_dir=str(tmp_path)))
    c, ours = loaded.config, loaded.model
    assert type(ours).__name__ == "GptOssForCausalLM"
    assert (c.num_local_experts, c.num_experts_per_tok, c.intermediate_size, c.head_dim, c.sliding_window) == \
        (8, 3, 32, 16, 8)
    assert [layer.self_attn.sliding_window for layer in ours.model.layers] == \
        [8 if t == "sliding_attention" else None for t in hf.config.layer_types]
    assert {k: c.rope_parameters[k] for k in SHORT_YARN} == {k: hf.config.rope_parameters[k] for k in SHORT_YARN}
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(our_logits(ours), want, atol=1e-4, rtol=1e-4)


def test_gpt_oss_gguf_greedy_tokens_match_transformers(written, tmp_path):
    path, hf = written
    llm = LLM(path, dtype="float32", cache_dir=str(tmp_path))
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                           max_new_tokens=16, do_sample=False, eos_token_id=None)[0, len(PROMPT):]
    out = llm.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == want.tolist()


def test_the_native_engine_would_take_the_experts_as_bf16(written, tmp_path):
    """expert_format "auto" for F32 and MXFP4 experts alike: bf16, which holds every finite MXFP4 value exactly."""
    path, _ = written
    model_dir = resolve_model_path(path, EngineConfig(cache_dir=str(tmp_path)))
    fmt, group, source = source_expert_format(model_dir, {})
    assert (fmt, group) == ("bf16", None) and source.startswith("GGUF experts")


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the overflowing scales, on purpose
def test_mxfp4_blocks_decode_bit_for_bit_as_ggml_lays_them_out(tmp_path):
    """ffn_down_exps in MXFP4 whose 16 experts x 13 rows x 16 blocks hold every byte value in every code position
    (expert r, block k: byte j is 16 k + (j + r) % 16) under scales from 2^-127 up to 255 (whose values overflow to
    inf, as ggml's float arithmetic makes them): the checkpoint's down_proj, whole and expert by expert, has the
    reference's bits."""
    scales = np.array([0, 1, 2, 3, 64, 120, 126, 127, 128, 129, 200, 254, 255], np.uint8)
    r, s, k, j = np.ogrid[:16, :len(scales), :16, :16]
    codes = (16 * k + (j + r) % 16).astype(np.uint8)
    raw = np.concatenate((np.broadcast_to(scales[(s + k) % len(scales)], (16, len(scales), 16, 1)),
                          np.broadcast_to(codes, (16, len(scales), 16, 16))), axis=-1).reshape(16, len(scales), -1)
    w = GGUFWriter(str(tmp_path / "blocks.gguf"), "gpt-oss")
    w.add_tensor("blk.0.ffn_down_exps.weight", np.ascontiguousarray(raw), raw_dtype=Q.MXFP4)
    finish(w)
    want = torch.from_numpy(reference_mxfp4(raw)).transpose(1, 2)  # down_proj [E, I, H] of ffn_down_exps [E, H, I]
    assert want.isinf().any() and (want == 0).any() and (want.abs().min(dim=-1).values > 0).any()
    ckpt = GGUFCheckpoint(GGUFFiles(tmp_path / "blocks.gguf"))
    name = "model.layers.0.mlp.experts.down_proj"
    assert ckpt.shape(name) == (16, 512, len(scales))
    assert torch.equal(ckpt.get(name).view(torch.int32), want.contiguous().view(torch.int32))
    experts = ckpt.fused_experts(name)
    assert len(experts) == 16
    for e in (0, 7, 15):
        assert torch.equal(experts[e].contiguous().view(torch.int32), want[e].contiguous().view(torch.int32))


@pytest.fixture(scope="module")
def hf_and_tokenizer(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpt_oss_parts")
    write_tokenizer(tmp, "gpt_oss", TINY["vocab_size"])
    return tiny_hf(), tmp


def write_config_case(tmp_path, hf_and_tokenizer, metadata: dict, omit: tuple[str, ...] = ()) -> GGUFFiles:
    hf, tokenizer_dir = hf_and_tokenizer
    write_gpt_oss_gguf(dict(hf.state_dict()), hf.config.to_dict(), tokenizer_dir, tmp_path / "model.gguf", Q.F32,
                       metadata, omit)
    return tmp_path / "model.gguf"


@pytest.mark.parametrize("pattern, sliding", [
    (None, [True, False, True]), (2, [True, False, True]), (3, [True, True, False]), (0, [True, True, True]),
    (1, [False, False, False]), ([False, True], [False, True, False]),
], ids=["absent", "period-2", "period-3", "period-0-all", "period-1-none", "array-shorter-than-the-layers"])
def test_the_sliding_window_pattern_becomes_layer_types_as_llama_cpp_reads_it(pattern, sliding, tmp_path,
                                                                               hf_and_tokenizer):
    metadata = {} if pattern is None else {"attention.sliding_window_pattern": pattern}
    path = write_config_case(tmp_path, hf_and_tokenizer, metadata)
    config = json.loads((resolve_model_path(path, EngineConfig(cache_dir="")) / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention" if s else "full_attention" for s in sliding]
    assert config["sliding_window"] == 8


def test_gpt_oss_gguf_tokenizer_splits_as_o200k_adds_no_bos_and_stops_at_harmony_ends(tmp_path, hf_and_tokenizer,
                                                                                      monkeypatch):
    """The pre-tokenizer's words are those tiktoken's own o200k pattern finds (its source, not its download);
    harmony's markers stay single tokens; generation stops where llama.cpp's text-found end tokens say; the chat
    template the file carries is read as harmony."""
    path = write_config_case(tmp_path, hf_and_tokenizer, {})
    model_dir = resolve_model_path(path, EngineConfig(cache_dir=str(tmp_path)))
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    monkeypatch.setattr(openai_public, "load_tiktoken_bpe", lambda *args, **kwargs: {})
    pattern = openai_public.o200k_harmony()["pat_str"]
    for text in ("HelloWorld's CAPS DON'T don't 1234567 foo/\n\nbar  baz\t", "naïve Café ÜBERstraße e\u0301t\u00e9!",
                 "x=a.b(c);//ok\r\n  ", "Hello World42"):
        ours = [text[a:b] for _, (a, b) in tok.pre_tokenizer.pre_tokenize_str(text)]
        assert ours == regex.findall(pattern, text), text
    tokens = [tok.id_to_token(i) for i in tok.encode("<|start|>assistant<|channel|>final<|message|>hi<|return|>").ids]
    assert tokens[0] == "<|start|>" and tokens[-1] == "<|return|>"
    assert [t for t in tokens if t.startswith("<|")] == ["<|start|>", "<|channel|>", "<|message|>", "<|return|>"]
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tok.token_to_id(t) for t in HARMONY_STOPS]
    assert "bos_token_id" not in generation
    assert parser_for_template(HybridTokenizer.from_dir(model_dir).chat_template).name == "harmony"


@pytest.mark.parametrize("key", ["attention.sliding_window", "expert_feed_forward_length",
                                 "attention.layer_norm_rms_epsilon"])
def test_gpt_oss_gguf_without_a_required_key_is_an_error(key, tmp_path, hf_and_tokenizer):
    path = write_config_case(tmp_path, hf_and_tokenizer, {}, omit=(key,))
    with pytest.raises(CheckpointError, match=f"lacks the metadata key gpt-oss.{key}"):
        resolve_model_path(path, EngineConfig(cache_dir=""))
