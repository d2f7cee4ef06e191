"""A random-weight GGUF of a make-model preset's exact shapes (cut to N layers), written the way llama.cpp's
converter lays a checkpoint out, so that llama.cpp and our engine load the same file; then llama-quantize.

Tensors are make-model's (hybridmoe/checkpoint/tensors.py: names, shapes, each one's mean and std), renamed by
the gguf package's own TensorNameMap (llama.cpp's names, not ours), a layer's routed experts stacked into one
tensor per projection ([E, I, H] gate and up, [E, H, I] down). Values come from torch's generator (on the GPU
when there is one), stored F16, with vectors and routers in F32 as the converter keeps them. DeepSeek's
kv_b_proj is written split (attn_k_b, attn_v_b: MLA as MQA over the latent, as current conversions are). The
tokenizer is make-model's, written as llama.cpp's tokenizer.ggml.* keys.

Families: qwen3_moe (qwen3moe), deepseek_v2 (deepseek2) and glm4_moe (glm4moe; no multi-token-prediction layer,
as make-model writes none).
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from hybridmoe.bench.synthetic import split_preset
from hybridmoe.checkpoint.presets import model_config
from hybridmoe.checkpoint.tensors import tensor_specs
from hybridmoe.checkpoint.tokenizer import write_tokenizer
from hybridmoe.errors import HybridMoEError

GGUF_ARCH = {"qwen3_moe": (gguf.MODEL_ARCH.QWEN3MOE, "qwen3moe"),
             "deepseek_v2": (gguf.MODEL_ARCH.DEEPSEEK2, "deepseek2"),
             "glm4_moe": (gguf.MODEL_ARCH.GLM4_MOE, "glm4moe")}
"""Our family -> llama.cpp's architecture (enum, general.architecture)."""
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_F32 = re.compile(r".*\.mlp\.gate\.weight|.*e_score_correction_bias")
"""2-D tensors the converter keeps in F32 (the routers); every vector is F32 too."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    """llama.cpp's name."""
    shape: tuple[int, ...]
    """numpy order (the file stores it reversed, as ggml's ne)."""
    qtype: Q
    mean: float
    std: float


def gguf_tensors(config: dict) -> list[GGUFTensor]:
    """The tensors of config's checkpoint in file order, under llama.cpp's names and types: a layer's routed
    experts one stacked tensor per projection where its expert 0 is."""
    arch, _ = GGUF_ARCH[config["model_type"]]
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    experts = config.get("num_experts") or config["n_routed_experts"]
    out = []

    def add(hf: str, shape: tuple[int, ...], mean: float, std: float) -> None:
        name = names.get_name(hf.replace("e_score_correction_bias", "e_score_correction.bias"),
                              try_suffixes=(".weight", ".bias"))
        if name is None:
            raise HybridMoEError(f"this gguf package has no llama.cpp name for {hf}")
        qtype = Q.F32 if len(shape) == 1 or _F32.fullmatch(hf) else Q.F16
        out.append(GGUFTensor(name, shape, qtype, mean, std))

    for s in tensor_specs(config):
        m = _EXPERT.fullmatch(s.name)
        if m is not None:
            if int(m.group(2)) == 0:
                add(f"model.layers.{m.group(1)}.mlp.experts.{m.group(3)}_proj.weight", (experts, *s.shape), s.mean,
                    s.std)
        elif s.name.endswith("kv_b_proj.weight"):  # [N * (D + V), R] as attn_k_b [N, R, D] + attn_v_b [N, V, R]
            heads, rank = config["num_attention_heads"], config["kv_lora_rank"]
            add(s.name.replace("kv_b_proj", "k_b_proj"), (heads, rank, config["qk_nope_head_dim"]), 0.0, s.std)
            add(s.name.replace("kv_b_proj", "v_b_proj"), (heads, config["v_head_dim"], rank), 0.0, s.std)
        else:
            add(s.name, s.shape, s.mean, s.std)
    return out


def write_metadata(w: gguf.GGUFWriter, config: dict) -> None:
    """The model keys llama.cpp's converter writes for config's family (the tokenizer's aside)."""
    c = config
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if c["model_type"] == "qwen3_moe":
        w.add_head_count_kv(c["num_key_value_heads"])
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
        w.add_rope_freq_base(c["rope_theta"])
        w.add_expert_count(c["num_experts"])
        return
    if c["model_type"] == "glm4_moe":
        _glm4moe_metadata(w, c)
        return
    rope = c["rope_scaling"]
    w.add_rope_freq_base(c["rope_theta"])
    w.add_leading_dense_block_count(c["first_k_dense_replace"])
    # llama.cpp reads q_lora_rank unless the depth is a Lite model's (27 layers); 0 means none
    w.add_q_lora_rank(c["q_lora_rank"] or 0)
    w.add_kv_lora_rank(c["kv_lora_rank"])
    w.add_head_count_kv(1)
    w.add_key_length(c["kv_lora_rank"] + c["qk_rope_head_dim"])
    w.add_value_length(c["kv_lora_rank"])
    w.add_key_length_mla(c["qk_nope_head_dim"] + c["qk_rope_head_dim"])
    w.add_value_length_mla(c["v_head_dim"])
    w.add_rope_dimension_count(c["qk_rope_head_dim"])
    w.add_expert_count(c["n_routed_experts"])
    w.add_expert_shared_count(c["n_shared_experts"])
    w.add_expert_weights_scale(c["routed_scaling_factor"])
    w.add_expert_weights_norm(bool(c["norm_topk_prob"]))
    if c.get("topk_method") != "greedy" and c.get("n_group", 1) > 1:
        w.add_expert_group_count(c["n_group"])
        w.add_expert_group_used_count(c["topk_group"])
    if rope and rope.get("type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _glm4moe_metadata(w: gguf.GGUFWriter, c: dict) -> None:
    """GLM-4.5's keys beside the shared ones: rotary over partial_rotary_factor of each head, sigmoid routing."""
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_rope_dimension_count(int(c["head_dim"] * c.get("partial_rotary_factor", 0.5)))
    w.add_rope_freq_base(c["rope_theta"])
    w.add_expert_count(c["n_routed_experts"])
    w.add_expert_shared_count(c["n_shared_experts"])
    w.add_leading_dense_block_count(c["first_k_dense_replace"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(c["routed_scaling_factor"])
    w.add_expert_weights_norm(bool(c["norm_topk_prob"]))
    w.add_expert_group_count(c["n_group"])
    w.add_expert_group_used_count(c["topk_group"])


def write_tokenizer_metadata(w: gguf.GGUFWriter, family: str, vocab_size: int) -> None:
    """make-model's tokenizer for family as llama.cpp's keys: a GPT-2 style BPE of exactly vocab_size tokens."""
    with tempfile.TemporaryDirectory() as tmp:
        ids = write_tokenizer(Path(tmp), family, vocab_size)
        tok = json.loads((Path(tmp) / "tokenizer.json").read_text())
        cfg = json.loads((Path(tmp) / "tokenizer_config.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    if len(tokens) != vocab_size:
        raise HybridMoEError(f"the {family} tokenizer has {len(tokens)} tokens, the config {vocab_size}")
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(ids["bos_token_id"])
    w.add_add_bos_token(bool(cfg.get("bos_token")))
    w.add_eos_token_id(ids["eos_token_id"])
    w.add_pad_token_id(ids["pad_token_id"])
    w.add_chat_template(cfg["chat_template"])


def random_values(t: GGUFTensor, g: torch.Generator, device: str, chunk_bytes: int = 256 << 20) -> np.ndarray:
    """t's values drawn from g (normal, t.mean, t.std) in t's type, generated a slice of rows at a time."""
    dtype = np.float32 if t.qtype == Q.F32 else np.float16
    out = np.empty(t.shape, dtype=dtype)
    flat = out.reshape(t.shape[0], -1)
    rows = max(1, chunk_bytes // (4 * flat.shape[1]))
    torch_dtype = torch.float32 if dtype == np.float32 else torch.float16
    for start in range(0, flat.shape[0], rows):
        n = min(rows, flat.shape[0] - start)
        v = torch.randn((n, flat.shape[1]), generator=g, device=device) * t.std + t.mean
        flat[start:start + n] = v.to(torch_dtype).cpu().numpy()
    return out


def write_random_gguf(config: dict, path: str | Path, seed: int = 0, device: str | None = None) -> dict:
    """config's checkpoint with random weights as an F16 GGUF at path; what was written."""
    family = config["model_type"]
    if family not in GGUF_ARCH:
        raise HybridMoEError(f"the peers' GGUF writer makes {', '.join(GGUF_ARCH)}, not {family}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    start = time.perf_counter()
    tensors = gguf_tensors(config)
    w = gguf.GGUFWriter(str(path), GGUF_ARCH[family][1])
    w.add_name(f"random {family} {config['num_hidden_layers']} layers")
    write_metadata(w, config)
    write_tokenizer_metadata(w, family, config["vocab_size"])
    for t in tensors:
        itemsize = 4 if t.qtype == Q.F32 else 2
        w.add_tensor_info(t.name, t.shape, np.dtype(np.float32 if itemsize == 4 else np.float16),
                          int(np.prod(t.shape)) * itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    g = torch.Generator(device=device).manual_seed(seed)
    for t in tensors:
        w.write_tensor_data(random_values(t, g, device))
    w.close()
    return {"path": str(path), "bytes": Path(path).stat().st_size, "tensors": len(tensors), "device": device,
            "seconds": time.perf_counter() - start}


def preset_config(preset: str, layers: int | None) -> dict:
    """A make-model preset's config.json ("qwen3-30b-a3b", "deepseek-v2-lite", "qwen3_moe:tiny"), cut to layers."""
    arch, name = split_preset(preset)
    config = model_config(arch, name, layers=layers)
    if arch not in GGUF_ARCH:
        raise HybridMoEError(f"--model {preset}: the peers' GGUF writer makes {', '.join(GGUF_ARCH)} presets")
    return config


def quantize(quantizer: str | Path, source: str | Path, out: str | Path, qtype: str, threads: int) -> dict:
    """llama-quantize source -> out in qtype; what it took."""
    start = time.perf_counter()
    cmd = [str(quantizer), str(source), str(out), qtype, str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
        raise HybridMoEError(f"llama-quantize to {qtype} failed (exit {done.returncode}):\n{tail}")
    return {"path": str(out), "bytes": Path(out).stat().st_size, "seconds": time.perf_counter() - start}
