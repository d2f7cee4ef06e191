"""Shared by the GGUF tests: write a Hugging Face checkpoint as GGUF the way llama.cpp's converter names it.

Imported by the test files beside it. Names come from the gguf package's own TensorNameMap (not from
hybridmoe), experts are stacked per layer into [E, rows, cols], and each tensor is stored in the
type `types(hf_name)` picks. gguf cannot quantize K-quants, so K-quant tensors get random blocks with
small scales: the reference model is whatever the file decodes to (`decoded`), quantizer or not.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

K_QUANTS = {Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K}
# byte offsets of each K-quant block's fp16 scale fields (d, and dmin where there is one)
_KQUANT_F16 = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def random_kquant(rows: int, cols: int, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """[rows, bytes] of valid blocks: random codes and sub-scales, fp16 scales in [2e-4, 1e-3]."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for off in _KQUANT_F16[qtype]:
        scale = rng.uniform(2e-4, 1e-3, size=(rows, cols // block)).astype(np.float16)
        raw[:, :, off:off + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return raw.reshape(rows, -1)


def encode(w: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """w [..., cols] float32 -> the bytes (or typed array) GGUFWriter stores."""
    if qtype == Q.F32:
        return w.astype(np.float32)
    if qtype in K_QUANTS:
        flat = w.reshape(-1, w.shape[-1])
        return random_kquant(flat.shape[0], flat.shape[1], qtype, rng).reshape(*w.shape[:-1], -1)
    return quantize(w, qtype)


def tokenizer_metadata(writer: gguf.GGUFWriter, tokenizer_dir: Path, pre: str = "default",
                       roles: dict[str, str] | None = None) -> None:
    """tokenizer.json + tokenizer_config.json -> llama.cpp's tokenizer.ggml.* keys and the chat template.

    pre: tokenizer.ggml.pre. roles: the special tokens' roles ("bos", "eos", "eot", "eom", "pad", "unk" -> token)
    where a converter sets them itself; else tokenizer_config.json's bos/eos/pad/unk_token.
    """
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    cfg = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    vocab = tok["model"]["vocab"]
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    writer.add_token_merges(merges)
    if roles is None:
        roles = {role: cfg.get(f"{role}_token") for role in ("bos", "eos", "pad", "unk")}
    for role, token in roles.items():
        if token:
            getattr(writer, f"add_{role}_token_id")(vocab[token])
    writer.add_add_bos_token(bool(cfg.get("bos_token")))
    writer.add_chat_template(cfg["chat_template"])


def write_tensors(w: gguf.GGUFWriter, tensors: dict[str, torch.Tensor], arch: gguf.MODEL_ARCH, layers: int, types,
                  rng: np.random.Generator, split_kv_b: bool = False) -> dict[str, torch.Tensor]:
    """Add every tensor under llama.cpp's name in the type types(hf_name) picks; return what each decodes to.

    split_kv_b: store DeepSeek's kv_b_proj [N * (D + V), R] as attn_k_b [N, R, D] + attn_v_b [N, V, R], as
    newer llama.cpp conversions do (N heads, D qk_nope_head_dim, V v_head_dim, R kv_lora_rank); the caller
    passes (N, D) as split_kv_b.
    """
    names = gguf.get_tensor_name_map(arch, layers)

    def add(hf: str, values: np.ndarray) -> np.ndarray:
        qtype = types(hf)
        data = encode(values, qtype, rng)
        # llama.cpp's converter spells the router's correction bias as a .bias of e_score_correction
        w.add_tensor(names.get_name(hf.replace("e_score_correction_bias", "e_score_correction.bias"),
                                    try_suffixes=(".weight", ".bias")), data, raw_dtype=qtype)
        return dequantize(data, qtype).reshape(values.shape)

    stacked: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    decoded = {}
    for name, t in tensors.items():
        m = _EXPERT.fullmatch(name)
        if m is not None:
            stacked.setdefault((int(m.group(1)), m.group(3)), {})[int(m.group(2))] = t
        elif split_kv_b and name.endswith("kv_b_proj.weight"):
            heads, nope = split_kv_b
            kv_b = t.float().reshape(heads, -1, t.shape[-1])  # [N, D + V, R]
            k_b = add(name.replace("kv_b_proj", "k_b_proj"), kv_b[:, :nope].transpose(1, 2).contiguous().numpy())
            v_b = add(name.replace("kv_b_proj", "v_b_proj"), kv_b[:, nope:].contiguous().numpy())
            decoded[name] = torch.from_numpy(np.concatenate((k_b.swapaxes(1, 2), v_b), axis=1).reshape(t.shape).copy())
        else:
            decoded[name] = torch.from_numpy(add(name, t.float().numpy()).copy())
    for (layer, proj), experts in sorted(stacked.items()):
        values = add(f"model.layers.{layer}.mlp.experts.{proj}_proj.weight",
                     torch.stack([experts[e] for e in sorted(experts)]).float().numpy())
        for e in sorted(experts):
            decoded[f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"] = torch.from_numpy(values[e].copy())
    return decoded


@torch.no_grad()
def randomize(hf) -> None:
    """A transformers model's weights redrawn at O(1) scale (transformers' 0.02 init leaves layers near the
    identity, hiding mistakes); seed 0."""
    gen = torch.Generator().manual_seed(0)
    for name, t in hf.state_dict().items():
        if name.endswith("e_score_correction_bias"):
            t.copy_(torch.randn(t.shape, generator=gen) * 0.3)
        elif name.endswith("norm.weight"):
            t.copy_(1 + 0.2 * torch.randn(t.shape, generator=gen))
        else:
            t.copy_(torch.randn(t.shape, generator=gen) * t.shape[-1] ** -0.5)


def finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def save_tiny_qwen3(tmp: Path, config: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """A transformers Qwen3-MoE of config, randomly initialized (seed 0), saved to tmp / "hf", with a
    tokenizer in tmp -> (its tensors, the saved config.json)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from hybridmoe.checkpoint.tokenizer import write_tokenizer
    from hybridmoe.weights.safetensors import SafetensorsCheckpoint

    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**config)).save_pretrained(tmp / "hf")
    with SafetensorsCheckpoint(tmp / "hf") as ckpt:
        tensors = {n: ckpt.get(n) for n in ckpt.weight_names()}
    write_tokenizer(tmp, "qwen3_moe", config["vocab_size"])
    return tensors, json.loads((tmp / "hf" / "config.json").read_text())


def write_qwen3_gguf(tensors: dict[str, torch.Tensor], config: dict, tokenizer_dir: Path, path: Path, types,
                     seed: int = 0, split_max_tensors: int = 0) -> dict[str, torch.Tensor]:
    """Write a Qwen3-MoE checkpoint (HF names -> float tensors) as GGUF; return what it decodes to (HF names).

    split_max_tensors > 0 writes a split, path-0000i-of-0000N.gguf, as llama.cpp's gguf-split does.
    """
    w = gguf.GGUFWriter(str(path), "qwen3moe", split_max_tensors=split_max_tensors)
    qwen3_metadata(w, config)
    tokenizer_metadata(w, tokenizer_dir)
    decoded = write_tensors(w, tensors, gguf.MODEL_ARCH.QWEN3MOE, config["num_hidden_layers"], types,
                            np.random.default_rng(seed))
    finish(w)
    return decoded


def qwen3_metadata(w: gguf.GGUFWriter, config: dict) -> None:
    """A Qwen3-MoE config.json's model keys (all but the tokenizer's), as llama.cpp's converter writes them."""
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_expert_count(config["num_experts"])
    w.add_expert_used_count(config["num_experts_per_tok"])
    w.add_expert_feed_forward_length(config["moe_intermediate_size"])


def shared_metadata(w: gguf.GGUFWriter, config: dict, blocks: int) -> None:
    """The model keys every family's conversion writes alike, from a transformers 5 config dict (rope_parameters)."""
    c = config
    w.add_block_count(blocks)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_rope_freq_base((c.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])


def write_deepseek_gguf(tensors: dict[str, torch.Tensor], config: dict, tokenizer_dir: Path, path: Path, types,
                        split_kv_b: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write a DeepseekV2/V3 checkpoint (transformers config dict) as llama.cpp's deepseek2 GGUF.

    split_kv_b: the newer conversion (MLA as MQA: head_count_kv 1, key/value_length of the latent, per-head
    sizes under *_mla, kv_b_proj split); else the older one (per-head key/value_length, whole attn_kv_b).
    V2-style files get no expert_gating_func key (files from before it existed mean softmax).
    """
    c = config
    rope = c.get("rope_parameters") or {}
    w = gguf.GGUFWriter(str(path), "deepseek2")
    shared_metadata(w, c, c["num_hidden_layers"])
    w.add_leading_dense_block_count(c["first_k_dense_replace"])
    if c.get("q_lora_rank"):
        w.add_q_lora_rank(c["q_lora_rank"])
    w.add_kv_lora_rank(c["kv_lora_rank"])
    qk_head_dim = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    if split_kv_b:
        w.add_head_count_kv(1)
        w.add_key_length(c["kv_lora_rank"] + c["qk_rope_head_dim"])
        w.add_value_length(c["kv_lora_rank"])
        w.add_key_length_mla(qk_head_dim)
        w.add_value_length_mla(c["v_head_dim"])
    else:
        w.add_head_count_kv(c["num_attention_heads"])
        w.add_key_length(qk_head_dim)
        w.add_value_length(c["v_head_dim"])
    w.add_rope_dimension_count(c["qk_rope_head_dim"])
    w.add_expert_count(c["n_routed_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_expert_shared_count(c["n_shared_experts"])
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_expert_weights_scale(c["routed_scaling_factor"])
    if c.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    if c.get("topk_method") != "greedy" and c.get("n_group"):
        w.add_expert_group_count(c["n_group"])
        w.add_expert_group_used_count(c["topk_group"])
    if c["model_type"] == "deepseek_v3":
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    tokenizer_metadata(w, tokenizer_dir)
    split = (c["num_attention_heads"], c["qk_nope_head_dim"]) if split_kv_b else False
    decoded = write_tensors(w, tensors, gguf.MODEL_ARCH.DEEPSEEK2, c["num_hidden_layers"], types,
                            np.random.default_rng(seed), split_kv_b=split)
    finish(w)
    return decoded


GLM_ROLES = {"bos": "[gMASK]", "eos": "<|endoftext|>", "eot": "<|user|>", "eom": "<|observation|>",
             "unk": "<|endoftext|>"}
"""The special tokens llama.cpp's converter gives a GLM-4.5 vocabulary (its _set_vocab_glm)."""


def write_glm4moe_gguf(tensors: dict[str, torch.Tensor], config: dict, tokenizer_dir: Path, path: Path, types,
                       nextn: int = 0, omit: tuple[str, ...] = (), seed: int = 0) -> dict[str, torch.Tensor]:
    """Write a Glm4MoeForCausalLM checkpoint (transformers config dict) as llama.cpp's glm4moe GGUF; return what
    it decodes to (HF names).

    nextn: how many multi-token-prediction layers tensors holds past num_hidden_layers (block_count counts them,
    nextn_predict_layers says how many). omit: glm4moe.* keys left out. q and k keep their rows: llama.cpp runs
    GLM's rotary NeoX-style, as transformers does.
    """
    c = config
    head_dim = c["head_dim"]
    w = gguf.GGUFWriter(str(path), "glm4moe")
    shared_metadata(w, c, c["num_hidden_layers"] + nextn)
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_expert_group_count(c["n_group"])
    w.add_expert_group_used_count(c["topk_group"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(int(head_dim * c["rope_parameters"].get("partial_rotary_factor", 0.5)))
    w.add_expert_count(c["n_routed_experts"])
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_expert_shared_count(c["n_shared_experts"])
    w.add_leading_dense_block_count(c["first_k_dense_replace"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(c["routed_scaling_factor"])
    w.add_expert_weights_norm(c["norm_topk_prob"])
    if nextn:
        w.add_nextn_predict_layers(nextn)
    tokenizer_metadata(w, tokenizer_dir, pre="glm4", roles=GLM_ROLES)
    decoded = write_tensors(w, tensors, gguf.MODEL_ARCH.GLM4_MOE, c["num_hidden_layers"] + nextn, types,
                            np.random.default_rng(seed))
    for key in omit:
        del w.kv_data[0][f"glm4moe.{key}"]
    finish(w)
    return decoded


def spm_tokenizer_metadata(writer: gguf.GGUFWriter, tokens: list[str], scores: list[float], types: list[int],
                           chat_template: str) -> None:
    """A SentencePiece vocabulary as llama.cpp writes a Llama/Mixtral one: <unk> 0, <s> 1, </s> 2, add BOS."""
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(True)
    writer.add_chat_template(chat_template)


_GPT_OSS_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias)?")


def _gpt_oss_expert_tensors(name: str, t: torch.Tensor) -> list[tuple[str, str, np.ndarray]]:
    """One fused gpt-oss expert tensor -> (HF-style name the name map knows, .weight/.bias, values) as llama.cpp's
    converter splits it: gate_up_proj [E, H, 2I] -> gate, up [E, I, H] (its even and odd columns, transposed), its
    bias [E, 2I] -> [E, I] each; down_proj [E, I, H] transposed to [E, H, I]; down_proj_bias as it is."""
    layer, part, bias = _GPT_OSS_EXPERTS.fullmatch(name).groups()
    base = f"model.layers.{layer}.mlp.experts."
    kind = ".bias" if bias else ".weight"
    v = t.float()
    if part == "down_proj":
        return [(base + "down_proj", kind, (v if bias else v.transpose(1, 2)).contiguous().numpy())]
    if not bias:
        v = v.transpose(1, 2)  # [E, 2I, H]: gate and up interleaved by row
    return [(base + "gate_proj", kind, v[:, ::2].contiguous().numpy()),
            (base + "up_proj", kind, v[:, 1::2].contiguous().numpy())]


def write_gpt_oss_gguf(tensors: dict[str, torch.Tensor], config: dict, tokenizer_dir: Path, path: Path,
                       expert_type: Q, metadata: dict | None = None,
                       omit: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """Write a GptOssForCausalLM checkpoint (transformers names and config dict) as llama.cpp's gpt-oss GGUF; return
    what each GGUF tensor stores (MXFP4: its raw blocks).

    The experts are split as the converter splits them (_gpt_oss_expert_tensors), their matrices stored in
    expert_type (F32, or MXFP4 quantized by gguf.quants), everything else F32; the sinks become attn_sinks.weight.
    metadata: further gpt-oss.* keys (key without the prefix -> value); omit: gpt-oss.* keys left out.
    """
    c = config
    rope = c["rope_parameters"]
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    shared_metadata(w, c, c["num_hidden_layers"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_expert_count(c["num_local_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_sliding_window(c["sliding_window"])
    w.add_expert_feed_forward_length(c["intermediate_size"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    add = {bool: w.add_bool, int: w.add_uint32, float: w.add_float32, list: w.add_array}
    for key, value in (metadata or {}).items():
        add[type(value)](f"gpt-oss.{key}", value)
    tokenizer_metadata(w, tokenizer_dir, pre="gpt-4o")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, c["num_hidden_layers"])
    stored = {}
    for name, t in tensors.items():
        if _GPT_OSS_EXPERTS.fullmatch(name):
            parts = _gpt_oss_expert_tensors(name, t)
        else:
            hf, kind = name.rpartition(".")[::2] if name.endswith((".weight", ".bias")) else (name, "weight")
            parts = [(hf, "." + kind, t.float().numpy())]
        for hf, kind, values in parts:
            qtype = expert_type if "experts" in hf and kind == ".weight" else Q.F32
            gguf_name = names.get_name(hf) + kind
            stored[gguf_name] = quantize(values, qtype) if qtype == Q.MXFP4 else values
            w.add_tensor(gguf_name, stored[gguf_name], raw_dtype=qtype)
    for key in omit:
        del w.kv_data[0][f"gpt-oss.{key}"]
    finish(w)
    return stored


def _tiled_value_heads(t: torch.Tensor, dim: int, key_heads: int, per_key: int, head_size: int) -> torch.Tensor:
    """llama.cpp's Qwen3.5 reorder along dim: value heads grouped by key head (K, r, d) -> tiled (r, K, d)."""
    shape = t.shape
    t = t.reshape(*shape[:dim], key_heads, per_key, head_size, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def _qwen35_reordered(name: str, t: torch.Tensor, c: dict) -> torch.Tensor:
    """_LinearAttentionVReorderBase.modify_tensors: a Gated DeltaNet tensor with its value heads tiled."""
    k_heads, v_heads, v_dim = c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_value_head_dim"]
    qk = 2 * k_heads * c["linear_key_head_dim"]
    r = v_heads // k_heads
    if ".in_proj_qkv." in name or ".conv1d." in name:
        return torch.cat((t[:qk], _tiled_value_heads(t[qk:], 0, k_heads, r, v_dim)))
    if ".in_proj_z." in name:
        return _tiled_value_heads(t, 0, k_heads, r, v_dim)
    if ".in_proj_b." in name or ".in_proj_a." in name or name.endswith((".A_log", ".dt_bias")):
        return _tiled_value_heads(t, 0, k_heads, r, 1)
    if ".out_proj." in name:
        return _tiled_value_heads(t, 1, k_heads, r, v_dim)
    return t


def _split_qkvz(t: torch.Tensor, c: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3NextModel.modify_tensors: in_proj_qkvz [per key head: q, k, v, z] -> attn_qkv (all q, all k, all v) and
    attn_gate (all z)."""
    k_heads, k_dim = c["linear_num_key_heads"], c["linear_key_head_dim"]
    vz = c["linear_num_value_heads"] // k_heads * c["linear_value_head_dim"]
    hidden = t.shape[1]
    q, k, v, z = t.t().reshape(hidden, k_heads, -1).split([k_dim, k_dim, vz, vz], dim=-1)
    qkv = torch.cat([q.reshape(hidden, -1), k.reshape(hidden, -1), v.reshape(hidden, -1)], dim=-1)
    return qkv.t().contiguous(), z.reshape(hidden, -1).t().contiguous()


def hybrid_converted(tensors: dict[str, torch.Tensor], config: dict, ssm_in: bool = False,
                     squeeze: bool = False) -> dict[str, torch.Tensor]:
    """A Qwen3-Next or Qwen3.5-MoE checkpoint's tensors as llama.cpp's converter hands them to the GGUF writer (names
    its TensorNameMap knows): Qwen3.5's value heads tiled, A_log -> -exp(A_log), dt_bias -> dt_proj.bias, conv1d
    squeezed, the (1 + weight) norms stored with the 1 added, Qwen3-Next's in_proj_qkvz split into in_proj_qkv and
    in_proj_z unless ssm_in (the older conversions' ssm_in, as it is). squeeze: every tensor squeezed, as older
    conversions write them (the shared expert's gate [1, H] -> [H])."""
    out = {}
    for name, t in tensors.items():
        t = t.float()
        if config["model_type"] != "qwen3_next" and "linear_attn." in name:
            t = _qwen35_reordered(name, t, config)
        if name.endswith(".A_log"):
            t = -torch.exp(t)
        elif name.endswith(".dt_bias"):
            name = name.replace(".dt_bias", ".dt_proj.bias")
        elif "conv1d" in name:
            t = t.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        if name.endswith("in_proj_qkvz.weight") and not ssm_in:
            out[name.replace("qkvz", "qkv")], out[name.replace("qkvz", "z")] = _split_qkvz(t, config)
            continue
        out[name] = t.squeeze() if squeeze else t
    return out


def hybrid_metadata(w: gguf.GGUFWriter, c: dict, nextn: int) -> None:
    """Qwen3NextModel.set_gguf_parameters (over TextModel's and Qwen2MoeModel's) for a config.json dict."""
    rope = c.get("rope_parameters") or {}
    head_dim = c["head_dim"]
    w.add_block_count(c["num_hidden_layers"] + nextn)
    if nextn:
        w.add_nextn_predict_layers(nextn)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    if c.get("intermediate_size"):
        w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    if "mrope_section" in rope:
        w.add_rope_dimension_sections((list(rope["mrope_section"]) + [0] * 4)[:4])
    w.add_rope_freq_base(rope.get("rope_theta", c.get("rope_theta")))
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    counts = {"expert_count": c["num_experts"], "expert_used_count": c["num_experts_per_tok"],
              "key_length": head_dim, "value_length": head_dim,
              "expert_feed_forward_length": c["moe_intermediate_size"],
              "expert_shared_feed_forward_length": c["shared_expert_intermediate_size"],
              "ssm_conv_kernel": c["linear_conv_kernel_dim"], "ssm_state_size": c["linear_key_head_dim"],
              "ssm_group_count": c["linear_num_key_heads"], "ssm_time_step_rank": c["linear_num_value_heads"],
              "ssm_inner_size": c["linear_value_head_dim"] * c["linear_num_value_heads"],
              "full_attention_interval": c.get("full_attention_interval", 4),
              "rope_dimension_count": int(head_dim * c.get("partial_rotary_factor", 0.25))}
    for key, value in counts.items():  # GGUFWriter.add_<key>
        getattr(w, f"add_{key}")(value)


def _add_fused_gate_up(w: gguf.GGUFWriter, experts: dict[str, torch.Tensor], types,
                       rng: np.random.Generator) -> dict[str, torch.Tensor]:
    """Each layer's experts' gate and up stacked as one blk.N.ffn_gate_up_exps [E, 2I, H] (gate's rows first), the
    converter's --fuse-gate-up-exps; returns what each expert's gate and up decode to."""
    decoded = {}
    layers = sorted({int(_EXPERT.fullmatch(n).group(1)) for n in experts})
    for layer in layers:
        count = len({n for n in experts if n.startswith(f"model.layers.{layer}.")}) // 2
        name = f"model.layers.{layer}.mlp.experts.{{e}}.{{proj}}_proj.weight"
        values = torch.stack([torch.cat((experts[name.format(e=e, proj="gate")], experts[name.format(e=e, proj="up")]))
                              for e in range(count)]).float().numpy()
        qtype = types(f"model.layers.{layer}.mlp.experts.gate_up_proj.weight")
        data = encode(values, qtype, rng)
        w.add_tensor(f"blk.{layer}.ffn_gate_up_exps.weight", data, raw_dtype=qtype)
        back = torch.from_numpy(dequantize(data, qtype).reshape(values.shape).copy())
        for e in range(count):
            gate, up = back[e].chunk(2)
            decoded[name.format(e=e, proj="gate")], decoded[name.format(e=e, proj="up")] = gate, up
    return decoded


def write_hybrid_gguf(tensors: dict[str, torch.Tensor], config: dict, tokenizer_dir: Path, path: Path, types, *,
                      ssm_in: bool = False, squeeze: bool = False, fuse_gate_up: bool = False,
                      extra: dict[str, np.ndarray] | None = None, nextn: int = 0, omit: tuple[str, ...] = (),
                      metadata: dict[str, list[bool]] | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write a Qwen3NextForCausalLM (qwen3next) or Qwen3_5MoeForCausalLM (qwen35moe) checkpoint, transformers names and
    config dict, as llama.cpp's converter writes it (hybrid_converted, hybrid_metadata); return what its tensors
    decode to (the routed experts under their checkpoint names).

    fuse_gate_up: experts' gate and up as one ffn_gate_up_exps. extra: GGUF name -> F32 values added as they are (a
    multi-token-prediction block past the decoder layers, nextn of them). omit: {arch}.* keys left out; metadata:
    further {arch}.* arrays (key without the prefix -> values)."""
    arch = gguf.MODEL_ARCH.QWEN3NEXT if config["model_type"] == "qwen3_next" else gguf.MODEL_ARCH.QWEN35MOE
    arch_name = gguf.MODEL_ARCH_NAMES[arch]
    w = gguf.GGUFWriter(str(path), arch_name)
    hybrid_metadata(w, config, nextn)
    tokenizer_metadata(w, tokenizer_dir, pre="qwen2" if arch == gguf.MODEL_ARCH.QWEN3NEXT else "qwen35")
    converted = hybrid_converted(tensors, config, ssm_in=ssm_in, squeeze=squeeze)
    fused = {n: t for n, t in converted.items()
             if fuse_gate_up and (m := _EXPERT.fullmatch(n)) is not None and m.group(3) != "down"}
    rng = np.random.default_rng(seed)
    decoded = write_tensors(w, {n: t for n, t in converted.items() if n not in fused}, arch,
                            config["num_hidden_layers"], types, rng)
    decoded.update(_add_fused_gate_up(w, fused, types, rng) if fused else {})
    for name, values in (extra or {}).items():
        w.add_tensor(name, values.astype(np.float32))
    for key, values in (metadata or {}).items():
        w.add_array(f"{arch_name}.{key}", values)
    for key in omit:
        del w.kv_data[0][f"{arch_name}.{key}"]
    finish(w)
    return decoded
