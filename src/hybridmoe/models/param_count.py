"""The parameters a checked config describes, by arithmetic: no module is built, so a config of a million layers
or a hidden size of a billion is sized at once, before anything is allocated (the loader sets the figure
against the machine's memory, system/model_memory.py).

The counts follow the families' modules term for term (tests/unit/test_param_count.py holds them to the models
built on the meta device): embeddings, lm_head unless tied, the norms, attention (GQA or MLA), dense MLPs,
routers, shared experts; the routed experts apart, since they live in the expert backend, not the model.

L layers, H hidden, V vocab, E routed experts, I intermediate size.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridmoe.models.base import ModelConfig, MoECausalLM


@dataclass(frozen=True)
class ParamCount:
    model: int
    """Every parameter of the model, the routed experts excepted."""
    routed_experts: int
    """gate + up + down of every routed expert of every MoE layer."""


def _gated_mlp(H: int, inter: int) -> int:
    return 3 * H * inter


def _gqa_attention(c: ModelConfig, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> int:
    H, q = c.hidden_size, c.num_attention_heads * c.head_dim
    kv = c.num_key_value_heads * c.head_dim
    return H * (q + 2 * kv) + q * H + (q + 2 * kv) * qkv_bias + H * o_bias + 2 * c.head_dim * qk_norm


def _mla_attention(c: ModelConfig) -> int:
    H, heads, bias = c.hidden_size, c.num_attention_heads, bool(c.attention_bias)
    qk_head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim
    if c.q_lora_rank is None:
        q = H * heads * qk_head_dim
    else:
        q = H * c.q_lora_rank + c.q_lora_rank * bias + c.q_lora_rank + c.q_lora_rank * heads * qk_head_dim
    kv_a = H * (c.kv_lora_rank + c.qk_rope_head_dim) + (c.kv_lora_rank + c.qk_rope_head_dim) * bias
    kv_b = c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)
    return q + kv_a + c.kv_lora_rank + kv_b + heads * c.v_head_dim * H + H * bias + _mla_indexer(c)


def _mla_indexer(c: ModelConfig) -> int:
    """DeepSeek-V3.2's lightning indexer (index_n_heads set): wq_b, wk, k_norm's weight and bias, weights_proj."""
    heads, dim = c.get("index_n_heads"), c.get("index_head_dim")
    if not heads:
        return 0
    return c.q_lora_rank * heads * dim + c.hidden_size * dim + 2 * dim + c.hidden_size * heads


def _multiples(lo: int, hi: int, step: int) -> int:
    """How many i in [lo, hi) are multiples of step."""
    return max(0, (hi - 1) // step - (lo - 1) // step) if hi > lo else 0


def _qwen(c: ModelConfig, qwen2: bool) -> tuple[int, int, int, int, int]:
    L, step = c.num_hidden_layers, c.decoder_sparse_step
    dense_only = {i for i in c.mlp_only_layers if (i + 1) % step == 0}
    moe_layers = L // step - len(dense_only)
    if qwen2:
        attention = _gqa_attention(c, bool(c.qkv_bias), False, False)
        shared = _gated_mlp(c.hidden_size, c.shared_expert_intermediate_size) + c.hidden_size
    else:
        attention = _gqa_attention(c, bool(c.attention_bias), bool(c.attention_bias), True)
        shared = 0
    return moe_layers, c.num_experts, c.moe_intermediate_size, attention, shared


def _mixtral(c: ModelConfig) -> tuple[int, int, int, int, int]:
    return c.num_hidden_layers, c.num_local_experts, c.intermediate_size, _gqa_attention(c, False, False, False), 0


def _deepseek(c: ModelConfig, v3: bool) -> tuple[int, int, int, int, int]:
    E = c.n_routed_experts
    moe_layers = _multiples(c.first_k_dense_replace, c.num_hidden_layers, c.moe_layer_freq)
    shared = _gated_mlp(c.hidden_size, c.moe_intermediate_size * (c.n_shared_experts or 0)) + E * v3  # + V3's bias
    return moe_layers, E, c.moe_intermediate_size, _mla_attention(c), shared


def _glm4_moe(c: ModelConfig) -> tuple[int, int, int, int, int]:
    E = c.n_routed_experts
    moe_layers = max(0, c.num_hidden_layers - c.first_k_dense_replace)
    attention = _gqa_attention(c, bool(c.attention_bias), False, bool(c.use_qk_norm))
    shared = _gated_mlp(c.hidden_size, c.moe_intermediate_size * (c.n_shared_experts or 0)) + E  # + the bias
    return moe_layers, E, c.moe_intermediate_size, attention, shared


def _minimax_m2(c: ModelConfig) -> tuple[int, int, int, int, int]:
    q_k = (c.num_attention_heads + c.num_key_value_heads) * c.head_dim  # q_norm and k_norm span all heads
    attention = _gqa_attention(c, False, False, False) + q_k
    return c.num_hidden_layers, c.num_local_experts, c.intermediate_size, attention, c.num_local_experts  # + the bias


def _gpt_oss(c: ModelConfig) -> tuple[int, int, int, int, int]:
    """Every layer MoE; the routed experts' biases (E (2I + H) a layer, beside 3 E H I) are not counted."""
    bias = bool(c.attention_bias)
    attention = _gqa_attention(c, bias, bias, False) + c.num_attention_heads  # + the sinks
    return c.num_hidden_layers, c.num_local_experts, c.intermediate_size, attention, c.num_local_experts  # + bias


def _qwen3_next(c: ModelConfig) -> tuple[int, int, int, list[int], int]:
    """Each layer's token mixer: Gated DeltaNet (in_proj_qkvz, in_proj_ba, conv1d, dt_bias, A_log, norm, out_proj) or
    gated attention (q_proj twice as wide: query and gate), per layer_types."""
    moe_layers, E, inter, _, _ = _qwen(c, qwen2=False)
    H, bias = c.hidden_size, bool(c.attention_bias)
    k, v = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
    channels, heads = 2 * k + v, c.linear_num_value_heads
    linear = H * (channels + v) + H * 2 * heads + channels * c.linear_conv_kernel_dim + 2 * heads \
        + c.linear_value_head_dim + v * H
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    full = H * (2 * q + 2 * kv) + q * H + (2 * q + 2 * kv + H) * bias + 2 * c.head_dim
    attention = [linear if kind == "linear_attention" else full for kind in c.layer_types]
    shared = _gated_mlp(H, c.shared_expert_intermediate_size) + H
    return moe_layers, E, inter, attention, shared


_FAMILIES = {
    "Qwen2MoeForCausalLM": lambda c: _qwen(c, qwen2=True),
    "Qwen3MoeForCausalLM": lambda c: _qwen(c, qwen2=False),
    "MixtralForCausalLM": _mixtral,
    "DeepseekV2ForCausalLM": lambda c: _deepseek(c, v3=False),
    "DeepseekV3ForCausalLM": lambda c: _deepseek(c, v3=True),
    "Glm4MoeForCausalLM": _glm4_moe,
    "GptOssForCausalLM": _gpt_oss,
    "MiniMaxM2ForCausalLM": _minimax_m2,
    "Qwen3NextForCausalLM": _qwen3_next,
}
"""Architecture -> (MoE layers, E, expert I, one layer's attention (a list of each layer's where they differ), one
MoE layer's parameters besides its router and routed experts)."""


def param_count(cls: type[MoECausalLM], config: ModelConfig) -> ParamCount:
    family = next(_FAMILIES[k.__name__] for k in cls.__mro__ if k.__name__ in _FAMILIES)
    moe_layers, E, expert_inter, attention, moe_extra = family(config)
    c, H = config, config.hidden_size
    dense_layers = c.num_hidden_layers - moe_layers
    embeddings = c.vocab_size * H * (1 if c.tie_word_embeddings else 2)
    layers = (sum(attention) if isinstance(attention, list) else c.num_hidden_layers * attention)
    layers += c.num_hidden_layers * 2 * H  # the two norms
    layers += dense_layers * _gated_mlp(H, c.intermediate_size) + moe_layers * (E * H + moe_extra)  # + the router
    return ParamCount(model=embeddings + layers + H, routed_experts=moe_layers * E * _gated_mlp(H, expert_inter))
