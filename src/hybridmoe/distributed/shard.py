"""A model built on the meta device, split in place into this rank's shard before its weights load.

- Attention (GQA): q/k/v column-parallel by heads (this rank's num_heads / world_size query heads and
  num_key_value_heads / world_size key/value heads: both must divide), o_proj row-parallel; the layer's head counts
  become this rank's, so its KV cache holds this rank's key/value heads only. Per-head q/k norms and the rotary
  embedding are whole on every rank; a layer's sliding window applies to every head alike. Attention sinks
  (gpt-oss: a logit per query head) are cut as the query heads are: this rank's Hq / world_size of them.
  Whole-q/k norms across heads (MiniMax-M2: q_norm over [Hq D], k_norm over [Hkv D]) become ShardedRMSNorms
  (distributed/sharded_norm.py) over this rank's heads' slice, their mean of squares all-reduced over the ranks.
- Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): q_proj (or q_b_proj) and kv_b_proj column-parallel by
  heads, o_proj row-parallel; q_a_proj, kv_a_proj_with_mqa and their norms whole. The latent KV cache is shared by
  every head, so every rank holds all of it.
- Dense MLPs and shared experts (GatedMLP): gate/up column-parallel, down row-parallel.
- The output head: column-parallel by vocabulary with its logits gathered on every rank, when it has its own
  weight and the world size divides the vocabulary; else (tied to the embeddings, or a vocabulary the world size
  does not divide) whole on every rank.
- Whole on every rank: the embeddings (a lookup costs nothing to repeat; splitting it would add an all-reduce per
  step for no saving but memory), every norm but the whole-q/k ones, the routers, Qwen2-MoE's shared-expert gate.

A row-parallel layer's all-reduce leaves every rank with the same hidden state, so everything whole is computed
alike everywhere. The decode GEMVs that read a row-parallel layer's weight directly (Attention and MLA's
fused_layer, CUDA) would skip its all-reduce: fused_layer is off in the split layers.

Layers this does not split are refused with a one-line error: any other attention (DeepSeek-V3.2's sparse MLA,
Qwen3-Next's gated attention) and a layer with a recurrent state (Gated DeltaNet).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridmoe.distributed.parallel_state import TensorParallel
from hybridmoe.distributed.sharded_linear import (
    ColumnParallelLinear,
    ColumnParallelMergedLinear,
    RowParallelLinear,
    VocabParallelHead,
)
from hybridmoe.distributed.sharded_norm import ShardedRMSNorm
from hybridmoe.errors import HybridMoEError
from hybridmoe.layers.attention import Attention
from hybridmoe.layers.mla import MultiHeadLatentAttention
from hybridmoe.layers.mlp import GatedMLP
from hybridmoe.models.base import MoECausalLM

SPLIT_ATTENTIONS = (Attention, MultiHeadLatentAttention)
"""The attention types split by heads (exactly these: a subclass computes more than they do)."""


def shard_model(model: MoECausalLM, tp: TensorParallel) -> None:
    """Replace model's layers, in place, by this rank's shard of them (before the weights load: the module
    docstring); a model with a layer this does not split is refused first."""
    check_splittable(model)
    for layer in model.model.layers:
        attention = layer.self_attn
        if type(attention) is Attention:
            _split_attention(attention, tp)
        else:
            _split_latent_attention(attention, tp)
    for name, module in list(model.named_modules()):
        if type(module) is GatedMLP:
            _split_mlp(module, name, tp)
    config = model.config
    if not config.tie_word_embeddings and config.vocab_size % tp.world_size == 0:
        model.lm_head = VocabParallelHead(config.hidden_size, config.vocab_size, tp)


def check_splittable(model: MoECausalLM) -> None:
    """A one-line HybridMoEError for the first layer of model that shard_model does not split."""
    family = type(model).__name__
    for name, module in model.model.layers.named_modules():
        why = None
        if hasattr(module, "allocate_state"):
            why = "keeps a recurrent state per sequence"
        elif hasattr(module, "allocate_kv_cache") and type(module) not in SPLIT_ATTENTIONS:
            why = "is an attention that tensor parallelism does not split by heads"
        if why is not None:
            raise HybridMoEError(f"{family} cannot run with tensor_parallel_size > 1: its {type(module).__name__} "
                                 f"(model.layers.{name}) {why}; run it with tensor_parallel_size 1")
    for i, layer in enumerate(model.model.layers):
        if type(getattr(layer, "self_attn", None)) not in SPLIT_ATTENTIONS:
            raise HybridMoEError(f"{family} cannot run with tensor_parallel_size > 1: its layer {i} has no "
                                 "attention split by heads; run it with tensor_parallel_size 1")


def _split_attention(attention: Attention, tp: TensorParallel) -> None:
    heads = tp.part(attention.num_heads, "the attention heads (num_attention_heads)")
    kv_heads = tp.part(attention.num_kv_heads, "the key/value heads (num_key_value_heads)")
    qkv, o = attention.qkv_proj, attention.o_proj
    attention.qkv_proj = ColumnParallelMergedLinear(qkv.in_features, qkv.out_sizes, tp, bias=qkv.bias is not None)
    attention.o_proj = RowParallelLinear(o.in_features, o.out_features, tp, bias=o.bias is not None)
    attention.num_heads, attention.num_kv_heads = heads, kv_heads
    attention.fused_layer = False
    if attention.sinks is not None:  # one per query head: this rank's heads' (checkpoint_slices.split_parameters)
        attention.sinks = nn.Parameter(torch.empty(heads, device=attention.sinks.device))
    if hasattr(attention, "q_norm") and not attention.qk_norm_per_head:
        attention.q_norm = ShardedRMSNorm(attention.q_norm.weight.numel(), attention.q_norm.eps, tp)
        attention.k_norm = ShardedRMSNorm(attention.k_norm.weight.numel(), attention.k_norm.eps, tp)


def _split_latent_attention(attention: MultiHeadLatentAttention, tp: TensorParallel) -> None:
    heads = tp.part(attention.num_heads, "the attention heads (num_attention_heads)")
    query = "q_proj" if hasattr(attention, "q_proj") else "q_b_proj"
    setattr(attention, query, _column_parallel(getattr(attention, query), tp))
    attention.kv_b_proj = _column_parallel(attention.kv_b_proj, tp)
    o = attention.o_proj
    attention.o_proj = RowParallelLinear(o.in_features, o.out_features, tp, bias=o.bias is not None)
    attention.num_heads = heads
    attention.fused_layer = False


def _column_parallel(linear: nn.Linear, tp: TensorParallel) -> ColumnParallelLinear:
    return ColumnParallelLinear(linear.in_features, linear.out_features, tp, bias=linear.bias is not None)


def _split_mlp(mlp: GatedMLP, name: str, tp: TensorParallel) -> None:
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    tp.part(gate_up.out_sizes[0], f"{name}'s intermediate size")
    mlp.gate_up_proj = ColumnParallelMergedLinear(gate_up.in_features, gate_up.out_sizes, tp)
    mlp.down_proj = RowParallelLinear(down.in_features, down.out_features, tp, bias=down.bias is not None)
