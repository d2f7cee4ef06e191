"""GGUF metadata -> the Hugging Face config.json of the same model, for the families we run.

general.architecture: qwen3moe -> Qwen3MoeForCausalLM, qwen2moe -> Qwen2MoeForCausalLM, llama
with experts -> MixtralForCausalLM. Which layers are dense (Qwen's mlp_only_layers) and whether
the embedding is tied are read off the tensors present, not guessed.
"""

from __future__ import annotations

import re

from hybridmoe.errors import CheckpointError
from hybridmoe.weights.gguf_file import GGUFFiles

SUPPORTED = {"qwen3moe": "Qwen3MoeForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM", "llama": "MixtralForCausalLM"}
"""GGUF general.architecture -> our model class (llama only with routed experts: Mixtral)."""

_MODEL_TYPE = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "llama": "mixtral"}
_ROUTER = re.compile(r"blk\.(\d+)\.ffn_gate_inp\.weight")


def mlp_name(arch: str) -> str:
    """The attribute holding a layer's MLP in the Hugging Face names (Mixtral: block_sparse_moe)."""
    return "block_sparse_moe" if arch == "llama" else "mlp"


def _first(value):
    # some keys (head_count_kv) may be per-layer arrays; our families use one value for all layers
    return value[0] if isinstance(value, list) else value


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
    if arch not in SUPPORTED or (arch == "llama" and not meta.get("llama.expert_count")):
        raise CheckpointError(f"GGUF architecture {arch!r} is not supported; supported: qwen3moe, qwen2moe, "
                              "llama with experts (Mixtral)")

    def get(key, default=None, required=False):
        full = f"{arch}.{key}"
        if required and full not in meta:
            raise CheckpointError(f"{gguf.paths[0]} lacks the metadata key {full}")
        return _first(meta.get(full, default))

    if "token_embd.weight" not in gguf.tensors:
        raise CheckpointError(f"{gguf.paths[0]} has no token_embd.weight tensor")
    layers = int(get("block_count", required=True))
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
    if arch == "llama":
        cfg.update(num_local_experts=experts, intermediate_size=int(get("feed_forward_length", required=True)),
                   sliding_window=None)
    else:
        cfg.update(num_experts=experts, moe_intermediate_size=int(get("expert_feed_forward_length", required=True)),
                   intermediate_size=_dense_size(gguf, moe_layers, get("feed_forward_length", 0)), decoder_sparse_step=1,
                   mlp_only_layers=[i for i in range(layers) if i not in moe_layers],
                   use_sliding_window=False, sliding_window=None)
    if arch == "qwen3moe":
        cfg.update(head_dim=int(get("attention.key_length", hidden // heads)),
                   norm_topk_prob=bool(get("expert_weights_norm", True)), attention_bias=False)
    if arch == "qwen2moe":
        shexp = "blk.0.ffn_gate_shexp.weight"
        cfg.update(shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length",
                                                           gguf.shape(shexp)[0] if shexp in gguf.tensors else 0)),
                   norm_topk_prob=bool(get("expert_weights_norm", False)),
                   qkv_bias="blk.0.attn_q.bias" in gguf.tensors)
    if get("rope.scaling.type") == "yarn":
        cfg["rope_scaling"] = {"type": "yarn", "factor": float(get("rope.scaling.factor", 1.0)),
                               "original_max_position_embeddings": int(get("rope.scaling.original_context_length",
                                                                           cfg["max_position_embeddings"]))}
    for role in ("bos", "eos", "pad"):
        if f"tokenizer.ggml.{role if role != 'pad' else 'padding'}_token_id" in meta:
            cfg[f"{role}_token_id"] = int(meta[f"tokenizer.ggml.{role if role != 'pad' else 'padding'}_token_id"])
    return cfg
