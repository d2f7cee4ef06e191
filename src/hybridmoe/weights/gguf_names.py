"""GGUF tensor names (llama.cpp's) -> the Hugging Face checkpoint names our models declare.

llama.cpp stacks a layer's routed experts into one tensor per projection (blk.N.ffn_gate_exps
[E, I, H]); here each becomes E per-expert names, so the loader's expert stacker sees a
Hugging Face checkpoint. For Llama-architecture files (Mixtral) llama.cpp's converter permuted
the rows of q and k for its rotary layout; unpermute_rows undoes that.
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
    "ffn_gate_shexp": "{mlp}.shared_expert.gate_proj", "ffn_up_shexp": "{mlp}.shared_expert.up_proj",
    "ffn_down_shexp": "{mlp}.shared_expert.down_proj", "ffn_gate_inp_shexp": "{mlp}.shared_expert_gate",
}

EXPERTS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}

_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_TOP = re.compile(r"(\w+)\.(weight|bias)")


def hf_name(gguf_name: str, mlp: str = "mlp") -> str | None:
    """A non-expert tensor's Hugging Face name, or None if it is an expert tensor or unknown."""
    m = _BLOCK.fullmatch(gguf_name)
    if m is not None:
        layer, part, kind = m.groups()
        if part not in _LAYER:
            return None
        return f"model.layers.{layer}.{_LAYER[part].format(mlp=mlp)}.{kind}"
    m = _TOP.fullmatch(gguf_name)
    if m is not None and m.group(1) in _GLOBAL:
        return f"{_GLOBAL[m.group(1)]}.{m.group(2)}"
    return None


def expert_tensor(gguf_name: str) -> tuple[int, str] | None:
    """(layer, "gate"|"up"|"down") if gguf_name holds a layer's stacked routed experts."""
    m = _BLOCK.fullmatch(gguf_name)
    if m is None or m.group(2) not in EXPERTS or m.group(3) != "weight":
        return None
    return int(m.group(1)), EXPERTS[m.group(2)]


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's Llama q/k permutation: rows (head, pair, half) -> (head, half, pair)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
