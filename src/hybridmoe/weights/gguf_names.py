"""GGUF tensor names (llama.cpp's) -> the Hugging Face checkpoint names our models declare.

llama.cpp stacks a layer's routed experts into one tensor per projection (blk.N.ffn_gate_exps
[E, I, H]); here each becomes E per-expert names, so the loader's expert stacker sees a
Hugging Face checkpoint. For Llama-architecture files (Mixtral) llama.cpp's converter permuted
the rows of q and k for its rotary layout; unpermute_rows undoes that. DeepSeek (deepseek2)
files keep the checkpoint's interleaved rotary rows as they are; newer conversions split MLA's
kv_b_proj into attn_k_b (per head, transposed) and attn_v_b, which join_kv_b puts back together.
GLM-4.5 (glm4moe) files keep the checkpoint's rows too (llama.cpp rotates them NeoX-style, as
transformers does) and call the pre-MLP norm post_attention_norm. The multi-token-prediction
layer a file may carry past the last decoder layer (blk.N.nextn.*) gets its checkpoint names
(model.layers.N.eh_proj, ...), which the models skip as beyond their last layer. gpt-oss files keep q and k
as they are too (NeoX-style rotary); their attention sinks (attn_sinks.weight) are self_attn.sinks, the router
(ffn_gate_inp, with a bias) is mlp.router, and their routed experts are shown as the checkpoint's fused tensors
by gguf_fused_experts.py. Qwen3-Next and Qwen3.5-MoE files (qwen3next, qwen35moe) name their Gated DeltaNet tensors
and their shifted norms through gguf_linear_attention.py; the rest of them as Qwen2-MoE's.
"""

from __future__ import annotations

import re

import torch

_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "{mlp}.gate_proj", "ffn_up": "{mlp}.up_proj", "ffn_down": "{mlp}.down_proj",
    "ffn_gate_inp": "{mlp}.gate",
    "ffn_gate_shexp": "{mlp}.{shared}.gate_proj", "ffn_up_shexp": "{mlp}.{shared}.up_proj",
    "ffn_down_shexp": "{mlp}.{shared}.down_proj", "ffn_gate_inp_shexp": "{mlp}.shared_expert_gate",
    # DeepSeek's multi-head latent attention and its router's correction bias
    "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
}

_SPECIAL = {("exp_probs_b", "bias"): "{mlp}.gate.e_score_correction_bias", ("attn_sinks", "weight"): "self_attn.sinks"}
"""(GGUF part, suffix) -> the whole HF suffix, for names that are not module + .weight/.bias."""

_ARCH_LAYER = {"glm4moe": {"post_attention_norm": "post_attention_layernorm"},
               "gpt-oss": {"post_attention_norm": "post_attention_layernorm", "ffn_gate_inp": "{mlp}.router"}}
"""Per-architecture additions to _LAYER."""

_NEXTN = {"eh_proj": "eh_proj", "enorm": "enorm", "hnorm": "hnorm", "embed_tokens": "embed_tokens",
          "shared_head_head": "shared_head.head", "shared_head_norm": "shared_head.norm"}
"""blk.N.nextn.<part> -> model.layers.N.<module>: the multi-token-prediction layer's own tensors."""

_SHARED = {"deepseek2": "shared_experts", "glm4moe": "shared_experts"}
"""The shared expert's module name where it is not Qwen2-MoE's "shared_expert"."""

_MLP = {"llama": "block_sparse_moe"}
"""The attribute holding a layer's MLP where it is not "mlp" (Mixtral)."""

EXPERTS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down", "ffn_gate_up_exps": "gate_up"}
"""Stacked routed-expert tensors -> their projection; gate_up: gate and up fused ([E, 2I, H], gate's rows first)."""
KV_B_PARTS = ("attn_k_b", "attn_v_b")
"""Newer llama.cpp conversions of DeepSeek store kv_b_proj as these two tensors."""

_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_NEXTN_BLOCK = re.compile(r"blk\.(\d+)\.nextn\.(\w+)\.(weight|bias)")
_TOP = re.compile(r"(\w+)\.(weight|bias)")


def mlp_name(arch: str) -> str:
    """The attribute holding a layer's MLP in the Hugging Face names (Mixtral: block_sparse_moe)."""
    return _MLP.get(arch, "mlp")


def hf_name(gguf_name: str, arch: str) -> str | None:
    """A non-expert tensor's Hugging Face name, or None if it is an expert tensor or unknown."""
    m = _BLOCK.fullmatch(gguf_name)
    if m is not None:
        layer, part, kind = m.groups()
        names = {"mlp": mlp_name(arch), "shared": _SHARED.get(arch, "shared_expert")}
        if (part, kind) in _SPECIAL:
            return f"model.layers.{layer}.{_SPECIAL[part, kind].format(**names)}"
        module = _ARCH_LAYER.get(arch, {}).get(part, _LAYER.get(part))
        return None if module is None else f"model.layers.{layer}.{module.format(**names)}.{kind}"
    m = _NEXTN_BLOCK.fullmatch(gguf_name)
    if m is not None and m.group(2) in _NEXTN:
        return f"model.layers.{m.group(1)}.{_NEXTN[m.group(2)]}.{m.group(3)}"
    m = _TOP.fullmatch(gguf_name)
    if m is not None and m.group(1) in _GLOBAL:
        return f"{_GLOBAL[m.group(1)]}.{m.group(2)}"
    return None


def expert_tensor(gguf_name: str) -> tuple[int, str] | None:
    """(layer, "gate"|"up"|"down"|"gate_up") if gguf_name holds a layer's stacked routed experts."""
    m = _BLOCK.fullmatch(gguf_name)
    if m is None or m.group(2) not in EXPERTS or m.group(3) != "weight":
        return None
    return int(m.group(1)), EXPERTS[m.group(2)]


def kv_b_part(gguf_name: str) -> int | None:
    """The layer if gguf_name is one half (attn_k_b or attn_v_b) of a split MLA kv_b_proj."""
    m = _BLOCK.fullmatch(gguf_name)
    if m is None or m.group(2) not in KV_B_PARTS or m.group(3) != "weight":
        return None
    return int(m.group(1))


def join_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """k_b [N, R, D] (each head's key half, transposed) and v_b [N, V, R] -> kv_b_proj [N * (D + V), R].

    N heads, R kv_lora_rank, D qk_nope_head_dim, V v_head_dim.
    """
    return torch.cat((k_b.transpose(1, 2), v_b), dim=1).reshape(-1, k_b.shape[1])


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's Llama q/k permutation: rows (head, pair, half) -> (head, half, pair)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
