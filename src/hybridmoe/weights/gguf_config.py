"""GGUF metadata -> the Hugging Face config.json of the same model, for the families we run.

general.architecture: qwen3moe -> Qwen3MoeForCausalLM, qwen2moe -> Qwen2MoeForCausalLM, llama
with experts -> MixtralForCausalLM, deepseek2 -> DeepseekV3ForCausalLM when its router scores by
sigmoid (V3, R1, Kimi-K2), else DeepseekV2ForCausalLM (V2, V2-Lite, V2.5), glm4moe ->
Glm4MoeForCausalLM (GLM-4.5, 4.5-Air, 4.6), gpt-oss -> GptOssForCausalLM (gpt-oss-20b, 120b), qwen3next ->
Qwen3NextForCausalLM (Qwen3-Next-80B-A3B), qwen35moe -> Qwen3_5MoeForCausalLM (Qwen3.5/3.6-MoE's text model).
Which layers are dense (Qwen's mlp_only_layers), whether the embedding is tied and whether GLM's
attention has q/k/v bias and q/k norm are read off the tensors present, not guessed. block_count
counts the multi-token-prediction layers a file carries past the decoder stack
({arch}.nextn_predict_layers of them), as llama.cpp does; num_hidden_layers does not.
The end-of-generation tokens llama.cpp stops at (tokenizer.ggml.eos/eot/eom_token_id) become a list
eos_token_id when there are several.

DeepSeek's GGUF metadata loses two things the HF config has, filled as llama.cpp runs the file:
- without expert_group_count / expert_group_used_count (files older than those keys) routing is
  not group-limited (n_group = topk_group = 1);
- YaRN's two mscales become one, rope.scaling.yarn_log_multiplier = 0.1 * mscale_all_dim; the
  released checkpoints set mscale = mscale_all_dim (so cos and sin are not rescaled), which is
  what is assumed here, as llama.cpp does.

gpt-oss's metadata is read as llama.cpp runs it: attention.sliding_window is the window; the layers it applies to
come from attention.sliding_window_pattern, an array of one bool per layer or a period n (layer i slides when
i % n < n - 1; 0: every layer), 2 when absent (the even layers slide, the release's alternation); YaRN's
beta_fast and beta_slow are 32 and 1 unless the file says otherwise, and its attention factor is YaRN's own
(0.1 ln(factor) + 1, times rope.scaling.attn_factor when set); the clamped SwiGLU's alpha 1.702 and limit 7.0
are llama.cpp's constants. One thing is not: ggml rounds YaRN's correction range to whole dimensions, which the
checkpoints' own config (rope truncate false, as OpenAI's reference computes it) does not; the config here
keeps the checkpoints' rotary, so a GGUF file computes what the model it was converted from does. llama.cpp stops
generation at <|return|>, <|call|> and <|endoftext|> (found by their text), as the release's generation_config
does; they join eos_token_id here.

Qwen3-Next and Qwen3.5-MoE (qwen3next, qwen35moe) are read as llama.cpp runs them: the Gated DeltaNet's shape from
the ssm.* keys (group_count key heads of state_size, time_step_rank value heads sharing inner_size, conv_kernel
taps), its layers from attention.recurrent_layers or full_attention_interval (gguf_linear_attention.py), a head's
rotated part from rope.dimension_count; routing is softmax top-k renormalized and unscaled whatever
expert_weights_norm, expert_weights_scale or expert_gating_func say (llama.cpp reads none of them for these two).
Qwen3.5's rope.dimension_sections become rope_parameters' mrope_section (for text every section turns by the same
position: plain rotary).
"""

from __future__ import annotations

import math
import re

from hybridmoe.errors import CheckpointError
from hybridmoe.weights.gguf_file import GGUFFiles
from hybridmoe.weights.gguf_linear_attention import HYBRID_ARCHS, delta_net_dims, recurrent_layers

SUPPORTED = {"qwen3moe": "Qwen3MoeForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM", "llama": "MixtralForCausalLM",
             "deepseek2": "DeepseekV2ForCausalLM", "glm4moe": "Glm4MoeForCausalLM", "gpt-oss": "GptOssForCausalLM",
             "qwen3next": "Qwen3NextForCausalLM", "qwen35moe": "Qwen3_5MoeForCausalLM"}
"""GGUF general.architecture -> our model class (llama only with routed experts: Mixtral; deepseek2 with
sigmoid gating: DeepseekV3ForCausalLM)."""

_MODEL_TYPE = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "llama": "mixtral", "deepseek2": "deepseek_v2",
               "glm4moe": "glm4_moe", "gpt-oss": "gpt_oss", "qwen3next": "qwen3_next", "qwen35moe": "qwen3_5_moe_text"}
_ROUTER = re.compile(r"blk\.(\d+)\.ffn_gate_inp\.weight")
_BLOCK = re.compile(r"blk\.(\d+)\.")
_END_OF_GENERATION = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
SOFTMAX, SIGMOID = 1, 2
"""{arch}.expert_gating_func values (llama.cpp's llama_expert_gating_func_type)."""
_HARMONY_STOPS = ("<|return|>", "<|call|>", "<|endoftext|>")
"""The end-of-generation tokens llama.cpp finds by their text in a gpt-oss (o200k_harmony) vocabulary."""


def _first(value):
    # some keys (head_count_kv) may be per-layer arrays; our families use one value for all layers
    return value[0] if isinstance(value, list) and value else value


def _number(gguf: GGUFFiles, key: str, value):
    """value (None: absent) if it is a finite number, else one line naming the key."""
    if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)):
        raise CheckpointError(f"{gguf.paths[0]}: GGUF metadata {key} must be a number, got {value!r:.40}")
    return value


def _block_count(gguf: GGUFFiles, arch: str, blocks, nextn) -> int:
    """The decoder layers: block_count less the multi-token-prediction layers, at least 1 and at most the layers
    the tensors hold (a flipped bit would otherwise make a config of billions of layers). A file converted
    without its prediction layers still counts them in block_count when it keeps nextn_predict_layers."""
    held = max((int(m.group(1)) for n in gguf.tensors if (m := _BLOCK.match(n))), default=-1) + 1
    layers = int(blocks) - int(nextn)
    if not 0 <= int(nextn) < int(blocks) or not 1 <= layers <= held:
        less = f" less {arch}.nextn_predict_layers {nextn}" if nextn else ""
        raise CheckpointError(f"{gguf.paths[0]}: GGUF metadata {arch}.block_count is {blocks}{less}, but its tensors "
                              f"hold {held} layers")
    return layers


def _dense_size(gguf: GGUFFiles, moe_layers: set[int], declared) -> int:
    """The dense MLP width: from a dense layer's tensor when there is one (unused when there is none)."""
    for name in gguf.tensors:
        m = re.fullmatch(r"blk\.(\d+)\.ffn_gate\.weight", name)
        if m and int(m.group(1)) not in moe_layers:
            return gguf.shape(name)[0]
    return int(declared or 0)


def hf_config(gguf: GGUFFiles) -> dict:
    meta = gguf.metadata
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or arch not in SUPPORTED or (arch == "llama" and not meta.get("llama.expert_count")):
        raise CheckpointError(f"GGUF architecture {arch!r:.40} is not supported; supported: qwen3moe, qwen2moe, "
                              "qwen3next, qwen35moe, deepseek2, glm4moe, gpt-oss, llama with experts (Mixtral)")

    def get(key, default=None, required=False):
        full = f"{arch}.{key}"
        if required and full not in meta:
            raise CheckpointError(f"{gguf.paths[0]} lacks the metadata key {full}")
        value = _first(meta.get(full, default))
        return value if key == "rope.scaling.type" else _number(gguf, full, value)

    if "token_embd.weight" not in gguf.tensors:
        raise CheckpointError(f"{gguf.paths[0]} has no token_embd.weight tensor")
    layers = _block_count(gguf, arch, get("block_count", required=True), get("nextn_predict_layers", 0))
    heads = int(get("attention.head_count", required=True))
    hidden = int(get("embedding_length", required=True))
    moe_layers = {int(m.group(1)) for n in gguf.tensors if (m := _ROUTER.fullmatch(n))}
    cfg = {
        "architectures": [SUPPORTED[arch]], "model_type": _MODEL_TYPE[arch],
        "vocab_size": gguf.shape("token_embd.weight")[0], "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in gguf.tensors, "hidden_act": "silu",
        "num_experts_per_tok": int(get("expert_used_count", required=True)), "torch_dtype": "bfloat16",
    }
    experts = int(get("expert_count", required=True))
    if arch == "deepseek2":
        _deepseek(cfg, gguf, get, experts, _dense_size(gguf, moe_layers, get("feed_forward_length", 0)))
    elif arch == "glm4moe":
        _glm4moe(cfg, gguf, get, experts, _dense_size(gguf, moe_layers, get("feed_forward_length", 0)))
    elif arch == "gpt-oss":
        _gpt_oss(cfg, gguf, get, experts)
    elif arch == "llama":
        cfg.update(num_local_experts=experts, intermediate_size=int(get("feed_forward_length", required=True)),
                   sliding_window=None)
    else:
        cfg.update(num_experts=experts, moe_intermediate_size=int(get("expert_feed_forward_length", required=True)),
                   intermediate_size=_dense_size(gguf, moe_layers, get("feed_forward_length", 0)),
                   decoder_sparse_step=1,
                   mlp_only_layers=[i for i in range(layers) if i not in moe_layers],
                   use_sliding_window=False, sliding_window=None)
    if arch == "qwen3moe":
        cfg.update(head_dim=int(get("attention.key_length", hidden // heads)),
                   norm_topk_prob=bool(get("expert_weights_norm", True)), attention_bias=False)
    if arch in ("qwen2moe", *HYBRID_ARCHS):
        shexp = "blk.0.ffn_gate_shexp.weight"
        cfg.update(shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length",
                                                           gguf.shape(shexp)[0] if shexp in gguf.tensors else 0)),
                   norm_topk_prob=bool(get("expert_weights_norm", False)))
    if arch == "qwen2moe":
        cfg["qkv_bias"] = "blk.0.attn_q.bias" in gguf.tensors
    if get("rope.scaling.type") == "yarn" and arch not in ("deepseek2", "gpt-oss"):
        cfg["rope_scaling"] = {"type": "yarn", "factor": float(get("rope.scaling.factor", 1.0)),
                               "original_max_position_embeddings": int(get("rope.scaling.original_context_length",
                                                                           cfg["max_position_embeddings"]))}
    if arch in HYBRID_ARCHS:
        _hybrid(cfg, gguf, get, arch)
    for role in ("bos", "eos", "pad"):
        if f"tokenizer.ggml.{role if role != 'pad' else 'padding'}_token_id" in meta:
            key = f"tokenizer.ggml.{role if role != 'pad' else 'padding'}_token_id"
            cfg[f"{role}_token_id"] = int(_number(gguf, key, meta[key]))
    stops = [int(_number(gguf, key, meta[key])) for key in _END_OF_GENERATION if key in meta]
    if arch == "gpt-oss":
        tokens = meta.get("tokenizer.ggml.tokens") or []
        stops += [tokens.index(t) for t in _HARMONY_STOPS if t in tokens]
    if len(set(stops)) > 1:
        cfg["eos_token_id"] = list(dict.fromkeys(stops))
    return cfg


def _deepseek(cfg: dict, gguf: GGUFFiles, get, experts: int, dense_size: int) -> None:
    """The DeepseekV2/V3 config.json fields, in place."""
    heads = cfg["num_attention_heads"]
    rope_dim = int(get("rope.dimension_count", required=True))
    # Newer conversions store MLA as MQA over the latent (head_count_kv 1, key_length kv_lora_rank + rope dim)
    # and the per-head sizes under *_mla; older ones store the per-head sizes as key/value_length.
    qk_head_dim = int(get("attention.key_length_mla", get("attention.key_length", required=True)))
    v_head_dim = int(get("attention.value_length_mla", get("attention.value_length", required=True)))
    sigmoid = int(get("expert_gating_func", SOFTMAX)) == SIGMOID
    n_group, topk_group = int(get("expert_group_count", 1)), int(get("expert_group_used_count", 1))
    q_lora_rank = get("attention.q_lora_rank")
    cfg.update(
        architectures=["DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"],
        model_type="deepseek_v3" if sigmoid else "deepseek_v2", num_key_value_heads=heads,
        intermediate_size=dense_size,
        moe_intermediate_size=int(get("expert_feed_forward_length", required=True)),
        n_routed_experts=experts, n_shared_experts=int(get("expert_shared_count", 0)),
        first_k_dense_replace=int(get("leading_dense_block_count", 0)), moe_layer_freq=1,
        routed_scaling_factor=float(get("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(get("expert_weights_norm", False)),
        q_lora_rank=int(q_lora_rank) if q_lora_rank else None,
        kv_lora_rank=int(get("attention.kv_lora_rank", required=True)),
        qk_rope_head_dim=rope_dim, qk_nope_head_dim=qk_head_dim - rope_dim, v_head_dim=v_head_dim,
        n_group=n_group, topk_group=topk_group, attention_bias=False,
    )
    if sigmoid:
        cfg.update(scoring_func="sigmoid", topk_method="noaux_tc", rope_interleave=True)
    else:
        cfg.update(scoring_func="softmax", topk_method="group_limited_greedy" if n_group > 1 else "greedy")
    if q_lora_rank is None and "blk.0.attn_q_a.weight" in gguf.tensors:
        raise CheckpointError(f"{gguf.paths[0]} has attn_q_a tensors but no deepseek2.attention.q_lora_rank")
    rope = {"rope_type": "default", "rope_theta": cfg["rope_theta"]}
    if get("rope.scaling.type") == "yarn":
        mscale = float(get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        rope = {"rope_type": "yarn", "rope_theta": cfg["rope_theta"], "factor": float(get("rope.scaling.factor", 1.0)),
                "original_max_position_embeddings": int(get("rope.scaling.original_context_length",
                                                            cfg["max_position_embeddings"])),
                "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),
                "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0)),
                "mscale": mscale, "mscale_all_dim": mscale, "attention_factor": 1.0}
    cfg["rope_parameters"] = rope


def _glm4moe(cfg: dict, gguf: GGUFFiles, get, experts: int, dense_size: int) -> None:
    """The Glm4MoeForCausalLM config.json fields, in place, with llama.cpp's defaults for absent keys: the whole
    head rotates, no routed scale, no renormalisation of the top-k weights, no groups, sigmoid routing."""
    path = gguf.paths[0]
    head_dim = int(get("attention.key_length", cfg["hidden_size"] // cfg["num_attention_heads"]))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise CheckpointError(f"{path}: glm4moe.attention.value_length differs from key_length {head_dim}; "
                              "GLM-4.5's heads have one size")
    factor = _rotary_factor(gguf, "glm4moe", head_dim, int(get("rope.dimension_count", head_dim)))
    gating = int(get("expert_gating_func", SIGMOID))
    if gating != SIGMOID:
        raise CheckpointError(f"{path}: glm4moe.expert_gating_func is {gating}; GLM-4.5 routes by sigmoid ({SIGMOID})")
    n_group = int(get("expert_group_count", 0)) or 1  # llama.cpp: 0 (absent) or 1 means no groups
    cfg.update(
        head_dim=head_dim, partial_rotary_factor=factor, intermediate_size=dense_size,
        moe_intermediate_size=int(get("expert_feed_forward_length", required=True)),
        n_routed_experts=experts, n_shared_experts=int(get("expert_shared_count", required=True)),
        first_k_dense_replace=int(get("leading_dense_block_count", 0)),
        routed_scaling_factor=float(get("expert_weights_scale", 0.0)) or 1.0,
        norm_topk_prob=bool(get("expert_weights_norm", False)),
        n_group=n_group, topk_group=int(get("expert_group_used_count", required=True)) if n_group > 1 else 1,
        attention_bias="blk.0.attn_q.bias" in gguf.tensors, use_qk_norm="blk.0.attn_q_norm.weight" in gguf.tensors,
        num_nextn_predict_layers=int(get("nextn_predict_layers", 0)),
    )


def _rotary_factor(gguf: GGUFFiles, arch: str, head_dim: int, rope_dim: int) -> float:
    """config.json's partial_rotary_factor of rope.dimension_count rotated dimensions of head_dim."""
    factor = rope_dim / head_dim
    if int(head_dim * factor) != rope_dim:
        raise CheckpointError(f"{gguf.paths[0]}: {arch}.rope.dimension_count {rope_dim} is not a fraction of head_dim "
                              f"{head_dim} that config.json's partial_rotary_factor can say")
    return factor


def _hybrid(cfg: dict, gguf: GGUFFiles, get, arch: str) -> None:
    """The Qwen3NextForCausalLM / Qwen3_5MoeForCausalLM config.json fields, in place (the module doc says how
    llama.cpp's keys are read)."""
    path = gguf.paths[0]
    head_dim = int(get("attention.key_length", cfg["hidden_size"] // cfg["num_attention_heads"]))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise CheckpointError(f"{path}: {arch}.attention.value_length differs from key_length {head_dim}; the "
                              "gated attention's heads have one size")
    factor = _rotary_factor(gguf, arch, head_dim, int(get("rope.dimension_count", head_dim)))
    dims = delta_net_dims(gguf, arch)
    layers = cfg["num_hidden_layers"]
    cfg.update(
        head_dim=head_dim, norm_topk_prob=True, attention_bias=any(n.endswith(".attn_q.bias") for n in gguf.tensors),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", required=True)),
        linear_conv_kernel_dim=int(get("ssm.conv_kernel", required=True)), linear_num_key_heads=dims.key_heads,
        linear_num_value_heads=dims.value_heads, linear_key_head_dim=dims.key_dim,
        linear_value_head_dim=dims.value_dim,
        layer_types=["linear_attention" if r else "full_attention" for r in recurrent_layers(gguf, arch, layers)],
    )
    if arch == "qwen3next":
        cfg["partial_rotary_factor"] = factor
        return
    key = f"{arch}.rope.dimension_sections"
    sections = gguf.metadata.get(key)
    if sections is None:
        raise CheckpointError(f"{path} lacks the metadata key {key}")
    if not isinstance(sections, list) or len(sections) < 3 or not all(type(n) is int and n >= 0 for n in sections):
        raise CheckpointError(f"{path}: GGUF metadata {key} must be an array of 3 or 4 counts, got {sections!r:.40}")
    scaling = cfg.pop("rope_scaling", None) or {}
    rope = {"rope_type": scaling.pop("type", "default"), **scaling}
    cfg["rope_parameters"] = {**rope, "rope_theta": cfg.pop("rope_theta"), "partial_rotary_factor": factor,
                              "mrope_section": sections[:3], "mrope_interleaved": True}


def _gpt_oss(cfg: dict, gguf: GGUFFiles, get, experts: int) -> None:
    """The GptOssForCausalLM config.json fields, in place (the module doc says how llama.cpp's keys are read)."""
    path, arch = gguf.paths[0], "gpt-oss"
    head_dim = int(get("attention.key_length", cfg["hidden_size"] // cfg["num_attention_heads"]))
    for key in ("attention.value_length", "rope.dimension_count"):
        if int(get(key, head_dim)) != head_dim:
            raise CheckpointError(f"{path}: {arch}.{key} {get(key)} differs from key_length {head_dim}; gpt-oss's "
                                  "heads have one size and rotate whole")
    base = cfg["rope_theta"]
    if float(get("rope.freq_base_swa", base)) != base:
        raise CheckpointError(f"{path}: {arch}.rope.freq_base_swa {get('rope.freq_base_swa')} differs from "
                              f"rope.freq_base {base}; gpt-oss's layers share one rotary")
    cfg.update(
        num_local_experts=experts, intermediate_size=int(get("expert_feed_forward_length", required=True)),
        head_dim=head_dim, rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", required=True)),
        sliding_window=int(get("attention.sliding_window", required=True)),
        layer_types=_layer_types(gguf, cfg["num_hidden_layers"]),
        rope_parameters=_gpt_oss_rope(get, base, cfg["max_position_embeddings"]),
        attention_bias="blk.0.attn_q.bias" in gguf.tensors, swiglu_alpha=1.702, swiglu_limit=7.0,
    )


def _layer_types(gguf: GGUFFiles, layers: int) -> list[str]:
    """llama.cpp's sliding-window layers (llama_hparams::set_swa_pattern, period 2 when the key is absent): an
    array's bools per layer (layers past its end: full), or a period n."""
    key = "gpt-oss.attention.sliding_window_pattern"
    pattern = gguf.metadata.get(key, 2)
    if isinstance(pattern, list):
        sliding = [bool(v) for v in pattern[:layers]] + [False] * max(0, layers - len(pattern))
    elif type(pattern) is int and pattern >= 0:
        sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(layers)]
    else:
        raise CheckpointError(f"{gguf.paths[0]}: GGUF metadata {key} must be a count or an array of bools, got "
                              f"{pattern!r:.40}")
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _gpt_oss_rope(get, base: float, context: int) -> dict:
    """config.json's rope_parameters: YaRN as llama.cpp applies it (with the checkpoints' unrounded correction
    range), linear scaling, or plain rotary when the file names no scaling or a factor of 1 (0: unset)."""
    kind, factor = get("rope.scaling.type"), float(get("rope.scaling.factor", 0.0))
    if kind in (None, "none") or factor in (0.0, 1.0):
        return {"rope_type": "default", "rope_theta": base}
    if kind == "linear":
        return {"rope_type": "linear", "rope_theta": base, "factor": factor}
    if kind != "yarn":
        raise CheckpointError(f"GGUF metadata gpt-oss.rope.scaling.type {kind!r:.40} is not one gpt-oss runs with "
                              "(yarn, linear or none)")
    rope = {"rope_type": "yarn", "rope_theta": base, "factor": factor, "truncate": False,
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length", context)),
            "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0))}
    attn_factor = float(get("rope.scaling.attn_factor", 1.0))
    if attn_factor != 1.0:
        rope["attention_factor"] = attn_factor * (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return rope
