"""Qwen3-Next (qwen3next) and Qwen3.5-MoE (qwen35moe) GGUF files, written here from make-model's tiny checkpoints as
llama.cpp's converter writes them (gguf_writer.write_hybrid_gguf), load and compute what the checkpoints compute: the
logits of a prompt longer than the delta rule's chunk equal both our load of the safetensors checkpoint and
transformers' at float32 tolerance, and 32 greedy tokens through the engine equal transformers' generate.

Both tiny models have 2 key heads each serving 2 value heads (Qwen3.5's files store them reordered), three Gated
DeltaNet layers and one gated-attention layer. The cases cover Qwen3-Next's two layouts of in_proj_qkvz (attn_qkv +
attn_gate; the older ssm_in), the older conversions' squeezed tensors, experts with gate and up fused, a
multi-token-prediction block past the decoder layers (which loading skips), an F32 file (the checkpoint's own values)
and Q8_0 experts (the reference checkpoint then holds the experts the file decodes to; every other tensor is F32).
Also: a missing required key names itself, a positive ssm_a (which stores -exp(A_log)) is refused, and Qwen3.5's
pre-tokenizer keeps combining marks in their word.
"""

import json
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_writer import write_hybrid_gguf
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from hybridmoe import LLM
from hybridmoe.checkpoint.make import make_checkpoint
from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.errors import CheckpointError
from hybridmoe.forward_context import Context, use_context
from hybridmoe.sampling_params import SamplingParams
from hybridmoe.weights.gguf_file import GGUFFiles
from hybridmoe.weights.gguf_model_dir import resolve_model_path
from hybridmoe.weights.gguf_tokenizer import tokenizer_files
from hybridmoe.weights.safetensors import SafetensorsCheckpoint

PROMPT = torch.randint(0, 512, (70,), generator=torch.Generator().manual_seed(5)).tolist()
"""Past one chunk of 64 of the delta rule."""
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
CASES = {
    # (make-model family, type of the routed experts, writer options, with a multi-token-prediction block)
    "qwen3next-f32-qkv-and-gate": ("qwen3_next", Q.F32, {}, False),
    "qwen3next-q8_0-fused-gate-up-ssm-in-squeezed-mtp": ("qwen3_next", Q.Q8_0,
                                                         {"ssm_in": True, "squeeze": True, "fuse_gate_up": True}, True),
    "qwen35moe-q8_0-mtp": ("qwen3_5_moe", Q.Q8_0, {}, True),
}
ARCH = {"qwen3_next": "qwen3next", "qwen3_5_moe": "qwen35moe"}


def expert_types(qtype: Q):
    """The routed experts in qtype, every other tensor F32."""
    return lambda name: qtype if ".mlp.experts." in name else Q.F32


def tiny_checkpoint(family: str, out) -> tuple[dict[str, torch.Tensor], dict]:
    """make-model's float32 tiny of family, every layer sparse (llama.cpp's qwen3next has no dense MLP tensors)."""
    make_checkpoint(family, "tiny", out, dtype="fp32", progress=False,
                    overrides={"mlp_only_layers": []} if family == "qwen3_next" else None)
    with SafetensorsCheckpoint(out) as ckpt:
        tensors = {n: ckpt.get(n) for n in ckpt.weight_names()}
    return tensors, json.loads((out / "config.json").read_text())


def mtp_block(config: dict) -> dict[str, np.ndarray]:
    """Some of a multi-token-prediction block as llama.cpp stores one at layer num_hidden_layers: a decoder layer's
    attention and experts plus its nextn.* tensors."""
    rng = np.random.default_rng(3)
    layer, hidden = config["num_hidden_layers"], config["hidden_size"]
    shapes = {"attn_norm.weight": (hidden,), "attn_q.weight": (2 * config["num_attention_heads"] * config["head_dim"],
                                                                hidden),
              "ffn_gate_exps.weight": (config["num_experts"], config["moe_intermediate_size"], hidden),
              "nextn.eh_proj.weight": (hidden, 2 * hidden), "nextn.enorm.weight": (hidden,)}
    return {f"blk.{layer}.{n}": rng.standard_normal(s) for n, s in shapes.items()}


def write_case(tmp, family: str, qtype: Q, options: dict, mtp: bool, omit: tuple[str, ...] = (),
               metadata: dict | None = None):
    """(GGUF path, the reference checkpoint directory: the tiny's own, or with the experts the file decodes to)."""
    tensors, config = tiny_checkpoint(family, tmp / "hf")
    extra = mtp_block(config) if mtp else {}
    decoded = write_hybrid_gguf(tensors, config, tmp / "hf", tmp / "model.gguf", expert_types(qtype), extra=extra,
                                nextn=int(mtp), omit=omit, metadata=metadata, **options)
    if qtype == Q.F32:
        return tmp / "model.gguf", tmp / "hf"
    ref = tmp / "ref"
    ref.mkdir()
    experts = {n: t for n, t in decoded.items() if ".mlp.experts." in n}
    assert len(experts) == 3 * config["num_experts"] * config["num_hidden_layers"]
    save_file({**tensors, **experts}, ref / "model.safetensors", metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tmp / "hf" / name, ref / name)
    return tmp / "model.gguf", ref


@pytest.fixture(scope="module", params=CASES)
def written(request, tmp_path_factory):
    family, qtype, options, mtp = CASES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    path, ref = write_case(tmp, family, qtype, options, mtp)
    hf = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    return request.param, path, ref, hf


@torch.no_grad()
def our_logits(model) -> torch.Tensor:
    model.allocate_kv_cache(1, 128)
    with use_context(Context(slot_ids=[0], start_pos=[0], cu_seqlens=[0, len(PROMPT)])):
        return model.compute_logits(model(torch.tensor(PROMPT), torch.arange(len(PROMPT))))


def test_gguf_logits_equal_the_checkpoint_and_transformers(written, tmp_path):
    _, path, ref, hf = written
    config = EngineConfig(dtype="float32", cache_dir=str(tmp_path))
    loaded, from_checkpoint = load_model(path, config), load_model(ref, config).model
    assert type(loaded.model).__name__ == type(from_checkpoint).__name__ == type(hf).__name__
    c = loaded.config
    assert c.layer_types == ["linear_attention"] * 3 + ["full_attention"] and c.rotary_dim == 4
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_conv_kernel_dim) == (2, 4, 4)
    assert loaded.model.moe_layers == [0, 1, 2, 3] and c.num_hidden_layers == 4
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0]
    ours = our_logits(loaded.model)
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours, our_logits(from_checkpoint), atol=1e-4, rtol=1e-4)


def test_gguf_greedy_tokens_equal_transformers(written, tmp_path):
    _, path, _, hf = written
    got = LLM(path, dtype="float32", cache_dir=str(tmp_path)).generate(PROMPT, GREEDY)[0].token_ids
    with torch.no_grad():
        want = hf.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                           do_sample=False, max_new_tokens=32, min_new_tokens=32, eos_token_id=None,
                           pad_token_id=0)[0, len(PROMPT):].tolist()
    assert got == want


REQUIRED = [("qwen3_next", key) for key in ("ssm.conv_kernel", "ssm.state_size", "ssm.group_count",
                                             "ssm.time_step_rank", "ssm.inner_size",
                                             "attention.layer_norm_rms_epsilon")] + \
    [("qwen3_5_moe", "rope.dimension_sections"), ("qwen3_5_moe", "ssm.inner_size")]


@pytest.mark.parametrize("family, key", REQUIRED)
def test_a_file_without_a_required_key_is_an_error_naming_it(family, key, tmp_path):
    path, _ = write_case(tmp_path, family, Q.F32, {}, False, omit=(key,))
    with pytest.raises(CheckpointError, match=f"lacks the metadata key {ARCH[family]}.{key}$"):
        resolve_model_path(path, EngineConfig(cache_dir=""))


def test_recurrent_layers_key_picks_the_gated_deltanet_layers_and_must_match_the_tensors(tmp_path):
    """attention.recurrent_layers (read before full_attention_interval, absent here) names the Gated DeltaNet layers;
    one that calls a layer holding DeltaNet tensors full attention is refused, naming the layer."""
    path, _ = write_case(tmp_path / "match", "qwen3_next", Q.F32, {}, False, omit=("full_attention_interval",),
                         metadata={"attention.recurrent_layers": [True, True, True, False]})
    config = json.loads((resolve_model_path(path, EngineConfig(cache_dir="")) / "config.json").read_text())
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    path, _ = write_case(tmp_path / "mismatch", "qwen3_next", Q.F32, {}, False,
                         metadata={"attention.recurrent_layers": [True, True, False, False]})
    with pytest.raises(CheckpointError, match="layer 2 holds blk.2.*makes it a full-attention layer"):
        load_model(path, EngineConfig(dtype="float32", cache_dir=str(tmp_path)))


def test_qwen35_pre_tokenizer_keeps_combining_marks_in_their_word(tmp_path):
    """tokenizer.ggml.pre "qwen35" splits as Qwen3.5's tokenizer.json does: "e" + U+0301 stays one word, where Qwen2's
    split makes the mark a word of its own."""
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.token_type": [1],
            "tokenizer.ggml.merges": []}
    words = {}
    for pre in ("qwen35", "qwen2"):
        tok, _ = tokenizer_files({**meta, "tokenizer.ggml.pre": pre})
        tok.save(str(tmp_path / f"{pre}.json"))
        words[pre] = [w for w, _ in Tokenizer.from_file(str(tmp_path / f"{pre}.json")).pre_tokenizer
                      .pre_tokenize_str("cafe\u0301 ok")]
    assert len(words["qwen35"]) == 2 and len(words["qwen2"]) == 3


def test_a_positive_ssm_a_is_an_error(tmp_path):
    """ssm_a stores -exp(A_log): a positive value cannot be read back as an A_log."""
    path, _ = write_case(tmp_path, "qwen3_5_moe", Q.F32, {}, False)
    raw = bytearray(path.read_bytes())
    gguf = GGUFFiles(path)
    tensor = gguf.tensors["blk.0.ssm_a"][0]
    start = int(tensor.data_offset)
    raw[start:start + 4] = np.float32(0.5).tobytes()
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="blk.0.ssm_a holds positive values"):
        load_model(path, EngineConfig(dtype="float32", cache_dir=str(tmp_path)))
