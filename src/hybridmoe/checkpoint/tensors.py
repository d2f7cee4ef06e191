"""Tensor names, shapes and initial values of each family's checkpoint, spelled as the real ones are.

Weight init (chosen so that a real-shape model's activations stay finite and its logits spread):
  - every linear weight [out, in]: normal, std 1/sqrt(in), so a layer maps unit-variance inputs
    to unit-variance outputs (router logits and lm_head logits come out with std ~1);
  - embed_tokens: normal, std 1 (the first RMSNorm sees unit-scale rows either way);
  - RMSNorm weights: 1 + normal(std 0.02), near 1 but not exactly, so a norm that fails to load shows; Qwen3-Next's
    norms, which scale by 1 + weight, normal(std 0.02) around 0 (the same scale);
  - Qwen3-Next's Gated DeltaNet: conv1d [Ch, 1, K] normal, std 1/sqrt(K); A_log and dt_bias normal, std 0.5 (decays
    exp(-exp(A_log) softplus(a + dt_bias)) spread over (0, 1));
  - attention biases (Qwen2, GLM-4.5): normal, std 0.02;
  - e_score_correction_bias (DeepSeek-V3 noaux_tc, GLM-4.5, MiniMax-M2): normal, std 0.01, stored float32 as in
    the real checkpoints; it shifts the choice of experts a little, never their weights;
  - gpt-oss: fused expert weights by the linear rule over their input dim, every bias std 0.02, attention sinks
    normal std 1 (so the heads differ in how much weight their sink takes);
  - Kimi-K2.5's vision tower: linears and norms by the rules above, every bias (its LayerNorms' too) std 0.02, the
    patch convolution std 1/sqrt(3 * patch * patch), the position embeddings std 0.02.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    mean: float
    std: float

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


TEXT_PREFIX = "language_model."
"""Where a multimodal checkpoint (Kimi-K2.5's) keeps its text model's tensors: language_model.model.*,
language_model.lm_head.weight."""

FP8_BLOCK = 128
"""make-model's block-FP8 checkpoints: one scale per 128x128 block, as DeepSeek-V3 ships."""
FP8_CODE_STD = 16.0
"""The e4m3 codes' spread (the largest is 448): the weight's spread lives in the block scales."""
_FLOAT_LINEARS = (".gate", ".router", ".shared_expert_gate", ".weights_proj", "lm_head")
"""Linears a block-FP8 checkpoint keeps in the model's dtype: the routers, DeepSeek-V3.2's indexer head weights and
the output head."""


class _Specs:
    """Collects TensorSpecs in checkpoint order with the init rules above. fp8: linear weights as e4m3 codes
    with a float32 scale_inv per 128x128 block (weight = code * scale_inv), but for _FLOAT_LINEARS."""

    def __init__(self, dtype: torch.dtype, fp8: bool = False):
        self.dtype, self.fp8 = dtype, fp8
        self.specs: list[TensorSpec] = []

    def linear(self, name: str, out_features: int, in_features: int) -> None:
        std = in_features ** -0.5
        if not self.fp8 or name.endswith(_FLOAT_LINEARS):
            self.specs.append(TensorSpec(f"{name}.weight", (out_features, in_features), self.dtype, 0.0, std))
            return
        blocks = (-(-out_features // FP8_BLOCK), -(-in_features // FP8_BLOCK))
        self.specs.append(TensorSpec(f"{name}.weight", (out_features, in_features), torch.float8_e4m3fn, 0.0,
                                     FP8_CODE_STD))
        self.specs.append(TensorSpec(f"{name}.weight_scale_inv", blocks, torch.float32, std / FP8_CODE_STD, 0.0))

    def bias(self, name: str, n: int) -> None:
        self.specs.append(TensorSpec(f"{name}.bias", (n,), self.dtype, 0.0, 0.02))

    def norm(self, name: str, n: int, mean: float = 1.0) -> None:
        """mean 0: a norm that scales by 1 + weight (Qwen3-Next's)."""
        self.specs.append(TensorSpec(f"{name}.weight", (n,), self.dtype, mean, 0.02))

    def embedding(self, name: str, vocab: int, hidden: int) -> None:
        self.specs.append(TensorSpec(f"{name}.weight", (vocab, hidden), self.dtype, 0.0, 1.0))

    def raw(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, std: float) -> None:
        self.specs.append(TensorSpec(name, shape, dtype, 0.0, std))

    def swiglu(self, prefix: str, hidden: int, inter: int, names=("gate_proj", "up_proj", "down_proj")) -> None:
        gate, up, down = names
        self.linear(f"{prefix}.{gate}", inter, hidden)
        self.linear(f"{prefix}.{up}", inter, hidden)
        self.linear(f"{prefix}.{down}", hidden, inter)


def _gqa_attention(s: _Specs, p: str, c: dict, *, qkv_bias: bool, qk_norm: bool, norm_per_head: bool = True) -> None:
    """norm_per_head False: q_norm and k_norm span all of q's and k's heads (MiniMax-M2)."""
    hidden, heads, kv_heads = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    for proj, n in (("q_proj", heads), ("k_proj", kv_heads), ("v_proj", kv_heads)):
        s.linear(f"{p}.self_attn.{proj}", n * head_dim, hidden)
        if qkv_bias:
            s.bias(f"{p}.self_attn.{proj}", n * head_dim)
    s.linear(f"{p}.self_attn.o_proj", hidden, heads * head_dim)
    if qk_norm:
        s.norm(f"{p}.self_attn.q_norm", head_dim if norm_per_head else heads * head_dim)
        s.norm(f"{p}.self_attn.k_norm", head_dim if norm_per_head else kv_heads * head_dim)


def _mla_attention(s: _Specs, p: str, c: dict) -> None:
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    qk_head = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    if c["q_lora_rank"] is None:
        s.linear(f"{p}.self_attn.q_proj", heads * qk_head, hidden)
    else:
        s.linear(f"{p}.self_attn.q_a_proj", c["q_lora_rank"], hidden)
        s.norm(f"{p}.self_attn.q_a_layernorm", c["q_lora_rank"])
        s.linear(f"{p}.self_attn.q_b_proj", heads * qk_head, c["q_lora_rank"])
    s.linear(f"{p}.self_attn.kv_a_proj_with_mqa", c["kv_lora_rank"] + c["qk_rope_head_dim"], hidden)
    s.norm(f"{p}.self_attn.kv_a_layernorm", c["kv_lora_rank"])
    s.linear(f"{p}.self_attn.kv_b_proj", heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"])
    s.linear(f"{p}.self_attn.o_proj", hidden, heads * c["v_head_dim"])
    if c.get("index_n_heads"):  # DeepSeek-V3.2's lightning indexer
        s.linear(f"{p}.self_attn.indexer.wq_b", c["index_n_heads"] * c["index_head_dim"], c["q_lora_rank"])
        s.linear(f"{p}.self_attn.indexer.wk", c["index_head_dim"], hidden)
        s.norm(f"{p}.self_attn.indexer.k_norm", c["index_head_dim"])
        s.bias(f"{p}.self_attn.indexer.k_norm", c["index_head_dim"])
        s.linear(f"{p}.self_attn.indexer.weights_proj", c["index_n_heads"], hidden)


def _qwen_mlp(s: _Specs, p: str, c: dict, i: int) -> None:
    hidden = c["hidden_size"]
    sparse = i not in c.get("mlp_only_layers", []) and c["num_experts"] > 0 \
        and (i + 1) % c.get("decoder_sparse_step", 1) == 0  # Qwen3.5-MoE has none: every layer sparse
    if not sparse:
        s.swiglu(f"{p}.mlp", hidden, c["intermediate_size"])
        return
    s.linear(f"{p}.mlp.gate", c["num_experts"], hidden)
    for e in range(c["num_experts"]):
        s.swiglu(f"{p}.mlp.experts.{e}", hidden, c["moe_intermediate_size"])
    if c["model_type"] in ("qwen2_moe", "qwen3_next", "qwen3_5_moe_text"):
        s.swiglu(f"{p}.mlp.shared_expert", hidden, c["shared_expert_intermediate_size"])
        s.linear(f"{p}.mlp.shared_expert_gate", 1, hidden)


def _deepseek_mlp(s: _Specs, p: str, c: dict, i: int) -> None:
    """DeepSeek's MLP, GLM-4.5's too: dense before first_k_dense_replace, else routed and shared experts; the
    router of sigmoid noaux_tc routing (V3's topk_method, GLM-4.5's only one) has an e_score_correction_bias."""
    hidden = c["hidden_size"]
    if i < c["first_k_dense_replace"] or i % c.get("moe_layer_freq", 1) != 0:
        s.swiglu(f"{p}.mlp", hidden, c["intermediate_size"])
        return
    s.linear(f"{p}.mlp.gate", c["n_routed_experts"], hidden)
    if c.get("topk_method") == "noaux_tc" or c["model_type"] == "glm4_moe":
        s.raw(f"{p}.mlp.gate.e_score_correction_bias", (c["n_routed_experts"],), torch.float32, 0.01)
    for e in range(c["n_routed_experts"]):
        s.swiglu(f"{p}.mlp.experts.{e}", hidden, c["moe_intermediate_size"])
    if c.get("n_shared_experts"):
        s.swiglu(f"{p}.mlp.shared_experts", hidden, c["moe_intermediate_size"] * c["n_shared_experts"])


def _mixtral_mlp(s: _Specs, p: str, c: dict, i: int) -> None:
    """Mixtral's MoE, MiniMax-M2's too, whose sigmoid router has an e_score_correction_bias on the block."""
    hidden = c["hidden_size"]
    s.linear(f"{p}.block_sparse_moe.gate", c["num_local_experts"], hidden)
    if c["model_type"] == "minimax_m2":
        s.raw(f"{p}.block_sparse_moe.e_score_correction_bias", (c["num_local_experts"],), torch.float32, 0.01)
    for e in range(c["num_local_experts"]):
        # w1 = gate, w3 = up, w2 = down, as in the original Mixtral release
        s.swiglu(f"{p}.block_sparse_moe.experts.{e}", hidden, c["intermediate_size"], names=("w1", "w3", "w2"))


def _gpt_oss_attention(s: _Specs, p: str, c: dict) -> None:
    _gqa_attention(s, p, c, qkv_bias=c["attention_bias"], qk_norm=False)
    if c["attention_bias"]:
        s.bias(f"{p}.self_attn.o_proj", c["hidden_size"])
    s.raw(f"{p}.self_attn.sinks", (c["num_attention_heads"],), s.dtype, 1.0)


def _gpt_oss_mlp(s: _Specs, p: str, c: dict) -> None:
    """The router with its bias, then every expert fused per part, as transformers saves GptOssExperts:
    gate_up_proj [E, H, 2I] (gate and up interleaved by column) and down_proj [E, I, H], each with a bias."""
    hidden, inter, E = c["hidden_size"], c["intermediate_size"], c["num_local_experts"]
    s.linear(f"{p}.mlp.router", E, hidden)
    s.bias(f"{p}.mlp.router", E)
    s.raw(f"{p}.mlp.experts.gate_up_proj", (E, hidden, 2 * inter), s.dtype, hidden ** -0.5)
    s.raw(f"{p}.mlp.experts.gate_up_proj_bias", (E, 2 * inter), s.dtype, 0.02)
    s.raw(f"{p}.mlp.experts.down_proj", (E, inter, hidden), s.dtype, inter ** -0.5)
    s.raw(f"{p}.mlp.experts.down_proj_bias", (E, hidden), s.dtype, 0.02)


def _qwen3_next_gated_attention(s: _Specs, p: str, c: dict) -> None:
    """Qwen3-Next's full attention (self_attn): q_proj also yields an output gate, (1 + weight) q/k norms."""
    hidden = c["hidden_size"]
    heads, kv_heads, head_dim = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    for proj, n in (("q_proj", 2 * heads), ("k_proj", kv_heads), ("v_proj", kv_heads)):
        s.linear(f"{p}.self_attn.{proj}", n * head_dim, hidden)
    s.linear(f"{p}.self_attn.o_proj", hidden, heads * head_dim)
    s.norm(f"{p}.self_attn.q_norm", head_dim, mean=0.0)
    s.norm(f"{p}.self_attn.k_norm", head_dim, mean=0.0)


def _qwen3_next_mixer(s: _Specs, p: str, c: dict, i: int) -> None:
    """Layer i's token mixer as layer_types (else full_attention_interval) says: Gated DeltaNet (linear_attn) or
    the gated full attention (self_attn)."""
    hidden, every = c["hidden_size"], c.get("full_attention_interval") or 4
    kind = c["layer_types"][i] if c.get("layer_types") else (
        "full_attention" if (i + 1) % every == 0 else "linear_attention")
    if kind == "full_attention":
        _qwen3_next_gated_attention(s, p, c)
        return
    k = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    v_heads = c["linear_num_value_heads"]
    v = v_heads * c["linear_value_head_dim"]
    kernel = c["linear_conv_kernel_dim"]
    s.raw(f"{p}.linear_attn.conv1d.weight", (2 * k + v, 1, kernel), s.dtype, kernel ** -0.5)
    s.raw(f"{p}.linear_attn.dt_bias", (v_heads,), s.dtype, 0.5)
    s.raw(f"{p}.linear_attn.A_log", (v_heads,), s.dtype, 0.5)
    if c["model_type"] == "qwen3_5_moe_text":  # Qwen3.5 stores the input projections split
        s.linear(f"{p}.linear_attn.in_proj_qkv", 2 * k + v, hidden)
        s.linear(f"{p}.linear_attn.in_proj_z", v, hidden)
        s.linear(f"{p}.linear_attn.in_proj_b", v_heads, hidden)
        s.linear(f"{p}.linear_attn.in_proj_a", v_heads, hidden)
    else:
        s.linear(f"{p}.linear_attn.in_proj_qkvz", 2 * k + 2 * v, hidden)
        s.linear(f"{p}.linear_attn.in_proj_ba", 2 * v_heads, hidden)
    s.norm(f"{p}.linear_attn.norm", c["linear_value_head_dim"])
    s.linear(f"{p}.linear_attn.out_proj", hidden, v)


def _qwen3_next_mtp(s: _Specs, c: dict) -> None:
    """Qwen3-Next's and Qwen3.5's multi-token-prediction module, as the releases store it (models/mtp.py reads it):
    fc [H, 2H] over the normed embedding and hidden state side by side, their two (1 + weight) norms,
    mtp_num_hidden_layers full-attention decoder layers (the sparse MoE block where the main stack's rule makes layer
    index K sparse) and a final norm."""
    hidden = c["hidden_size"]
    s.linear("mtp.fc", hidden, 2 * hidden)
    s.norm("mtp.pre_fc_norm_embedding", hidden, mean=0.0)
    s.norm("mtp.pre_fc_norm_hidden", hidden, mean=0.0)
    for k in range(c["mtp_num_hidden_layers"]):
        p = f"mtp.layers.{k}"
        s.norm(f"{p}.input_layernorm", hidden, mean=0.0)
        _qwen3_next_gated_attention(s, p, c)
        s.norm(f"{p}.post_attention_layernorm", hidden, mean=0.0)
        _qwen_mlp(s, p, c, k)
    s.norm("mtp.norm", hidden, mean=0.0)


def _moonvit(s: _Specs, v: dict, text_hidden: int) -> None:
    """Kimi-K2.5's vision tower (MoonViT: a patch embedding, pre-norm blocks with a fused qkv, every linear and
    LayerNorm with a bias) and mm_projector, which maps merge_kernel_size patches to one text embedding; named and
    shaped from vision_config as the release stores them. The text model never reads them."""
    hidden, inter, patch = v["vt_hidden_size"], v["vt_intermediate_size"], v["patch_size"]
    s.raw("vision_tower.patch_embed.proj.weight", (hidden, 3, patch, patch), s.dtype, (3 * patch * patch) ** -0.5)
    s.bias("vision_tower.patch_embed.proj", hidden)
    s.raw("vision_tower.patch_embed.pos_emb.weight", (v["init_pos_emb_height"], v["init_pos_emb_width"], hidden),
          s.dtype, 0.02)
    for i in range(v["vt_num_hidden_layers"]):
        p = f"vision_tower.encoder.blocks.{i}"
        for name, out_features, in_features in (("wqkv", 3 * hidden, hidden), ("wo", hidden, hidden),
                                                ("mlp.fc0", inter, hidden), ("mlp.fc1", hidden, inter)):
            s.linear(f"{p}.{name}", out_features, in_features)
            s.bias(f"{p}.{name}", out_features)
        for norm in (f"{p}.norm0", f"{p}.norm1"):
            s.norm(norm, hidden)
            s.bias(norm, hidden)
    merged = hidden * math.prod(v["merge_kernel_size"])
    for norm, n in (("vision_tower.encoder.final_layernorm", hidden), ("mm_projector.pre_norm", hidden)):
        s.norm(norm, n)
        s.bias(norm, n)
    for name, out_features, in_features in (("mm_projector.proj.0", merged, merged),
                                            ("mm_projector.proj.2", text_hidden, merged)):
        s.linear(name, out_features, in_features)
        s.bias(name, out_features)


def _multimodal_specs(config: dict) -> list[TensorSpec]:
    """A multimodal checkpoint (Kimi-K2.5's layout): text_config's model under TEXT_PREFIX, then the vision tower,
    in the text model's dtype and never FP8 (the releases keep it unquantized)."""
    text = config["text_config"]
    s = _Specs(torch.bfloat16 if text["torch_dtype"] == "bfloat16" else torch.float32)
    _moonvit(s, config["vision_config"], text["hidden_size"])
    return [replace(spec, name=TEXT_PREFIX + spec.name) for spec in tensor_specs(text)] + s.specs


def tensor_specs(config: dict) -> list[TensorSpec]:
    """Every tensor of the checkpoint described by `config` (a config.json dict), in file order."""
    if "text_config" in config:
        return _multimodal_specs(config)
    mt = config["model_type"]
    fp8 = (config.get("quantization_config") or {}).get("quant_method") == "fp8"
    s = _Specs(torch.bfloat16 if config["torch_dtype"] == "bfloat16" else torch.float32, fp8)
    hidden = config["hidden_size"]
    norm_mean = 0.0 if mt in ("qwen3_next", "qwen3_5_moe_text") else 1.0
    s.embedding("model.embed_tokens", config["vocab_size"], hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        s.norm(f"{p}.input_layernorm", hidden, norm_mean)
        if mt.startswith("deepseek") or mt == "kimi_k2":  # Kimi-K2 is DeepSeek-V3's architecture
            _mla_attention(s, p, config)
        elif mt == "glm4_moe":
            _gqa_attention(s, p, config, qkv_bias=config["attention_bias"], qk_norm=config["use_qk_norm"])
        elif mt == "minimax_m2":
            _gqa_attention(s, p, config, qkv_bias=False, qk_norm=True, norm_per_head=False)
        elif mt == "gpt_oss":
            _gpt_oss_attention(s, p, config)
        elif mt in ("qwen3_next", "qwen3_5_moe_text"):
            _qwen3_next_mixer(s, p, config, i)
        else:
            _gqa_attention(s, p, config, qkv_bias=mt == "qwen2_moe", qk_norm=mt == "qwen3_moe")
        s.norm(f"{p}.post_attention_layernorm", hidden, norm_mean)
        if mt.startswith("deepseek") or mt in ("glm4_moe", "kimi_k2"):
            _deepseek_mlp(s, p, config, i)
        elif mt in ("mixtral", "minimax_m2"):
            _mixtral_mlp(s, p, config, i)
        elif mt == "gpt_oss":
            _gpt_oss_mlp(s, p, config)
        else:
            _qwen_mlp(s, p, config, i)
    s.norm("model.norm", hidden, norm_mean)
    s.linear("lm_head", config["vocab_size"], hidden)
    if mt in ("qwen3_next", "qwen3_5_moe_text") and config.get("mtp_num_hidden_layers", 0) > 0:
        _qwen3_next_mtp(s, config)  # only when asked: checkpoints without the key stay as they were
    return s.specs
