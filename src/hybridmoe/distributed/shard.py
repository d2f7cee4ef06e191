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
- Gated attention (Qwen3-Next, Qwen3.5): split as GQA; q_proj's rows hold each query head's query and gate
  together, so a rank's query heads bring their gates. Its per-head q/k norms are whole on every rank.
- Gated DeltaNet (Qwen3-Next, Qwen3.5): split by key heads, each with the value heads it serves (value head j uses
  key head j // r, so a rank's key heads' value heads are consecutive too). The input projections column-parallel:
  Qwen3-Next's in_proj_qkvz and in_proj_ba hold their rows per key head, so a rank's slice of each is its heads'
  q, k, v, z (and b, a); Qwen3.5's flat in_proj_qkv is cut per part (all q, all k, all v heads: the rank's slice of
  each), in_proj_z, in_proj_b and in_proj_a as they are. The depthwise convolution's channels (q, k, v parts alike),
  A_log and dt_bias are cut to the rank's heads, out_proj row-parallel; the gated RMSNorm is per value head, whole.
  The layer's head counts become this rank's, so allocate_state gives each rank its own heads' conv and recurrent
  states per slot and per snapshot; the step context's state_restores and state_saves reach every rank (the
  lockstep Forward), so each keeps and restores its heads' states in the same snapshot rows.
- Dense MLPs and shared experts (GatedMLP): gate/up column-parallel, down row-parallel.
- The output head: column-parallel by vocabulary with its logits gathered on every rank, when it has its own
  weight and the world size divides the vocabulary; else (tied to the embeddings, or a vocabulary the world size
  does not divide) whole on every rank.
- Whole on every rank: the embeddings (a lookup costs nothing to repeat; splitting it would add an all-reduce per
  step for no saving but memory), every norm but the whole-q/k ones, the routers, the shared-expert gates of
  Qwen2-MoE, Qwen3-Next and Qwen3.5.

A row-parallel layer's all-reduce leaves every rank with the same hidden state, so everything whole is computed
alike everywhere. The decode GEMVs that read a row-parallel layer's weight directly (Attention and MLA's
fused_layer, CUDA) would skip its all-reduce: fused_layer is off in the split layers.

Layers this does not split are refused with a one-line error: any other attention (DeepSeek-V3.2's sparse MLA) and
any other layer with a recurrent state.
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
from hybridmoe.layers.gated_attention import GatedAttention
from hybridmoe.layers.linear_attention import GatedDeltaNet
from hybridmoe.layers.mla import MultiHeadLatentAttention
from hybridmoe.layers.mlp import GatedMLP
from hybridmoe.models.base import MoECausalLM

SPLIT_ATTENTIONS = (Attention, GatedAttention, MultiHeadLatentAttention)
"""The attention types split by heads (exactly these: a subclass computes more than they do)."""

SPLIT_STATEFUL = (GatedDeltaNet,)
"""The layers with a recurrent state split by heads (exactly these)."""

MIXERS = ("self_attn", "linear_attn")
"""The names a decoder layer's token mixer goes by."""


def shard_model(model: MoECausalLM, tp: TensorParallel) -> None:
    """Replace model's layers, in place, by this rank's shard of them (before the weights load: the module
    docstring); a model with a layer this does not split is refused first."""
    check_splittable(model)
    for layer in model.model.layers:
        mixer = _mixer(layer)
        if type(mixer) in (Attention, GatedAttention):
            _split_attention(mixer, tp)
        elif type(mixer) is GatedDeltaNet:
            _split_deltanet(mixer, tp)
        else:
            _split_latent_attention(mixer, tp)
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
        if hasattr(module, "allocate_state") and type(module) not in SPLIT_STATEFUL:
            why = "keeps a recurrent state per sequence"
        elif hasattr(module, "allocate_kv_cache") and type(module) not in SPLIT_ATTENTIONS:
            why = "is an attention that tensor parallelism does not split by heads"
        if why is not None:
            raise HybridMoEError(f"{family} cannot run with tensor_parallel_size > 1: its {type(module).__name__} "
                                 f"(model.layers.{name}) {why}; run it with tensor_parallel_size 1")
    for i, layer in enumerate(model.model.layers):
        if type(_mixer(layer)) not in (*SPLIT_ATTENTIONS, *SPLIT_STATEFUL):
            raise HybridMoEError(f"{family} cannot run with tensor_parallel_size > 1: its layer {i} has no "
                                 "attention split by heads; run it with tensor_parallel_size 1")


def _mixer(layer: nn.Module) -> nn.Module | None:
    """layer's token mixer (its self_attn, or its linear_attn: Qwen3-Next's DeltaNet layers), or None."""
    for name in MIXERS:
        mixer = getattr(layer, name, None)
        if mixer is not None:
            return mixer
    return None


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


def _split_deltanet(layer: GatedDeltaNet, tp: TensorParallel) -> None:
    k_heads = tp.part(layer.num_k_heads, "the linear-attention key heads (linear_num_key_heads)")
    v_heads = layer.num_v_heads // tp.world_size  # a multiple of the key heads (the model's config check)
    qkvz, ba, conv, o = layer.in_proj_qkvz, layer.in_proj_ba, layer.conv1d, layer.out_proj
    hidden = o.out_features
    if layer.flat_projections:  # in_proj_qkv: all q heads, all k heads, all v heads, each cut by heads
        q = layer.num_k_heads * layer.k_dim
        layer.in_proj_qkvz = ColumnParallelMergedLinear(hidden, qkvz.out_sizes, tp,
                                                        shard_parts=[(q, q, layer.num_v_heads * layer.v_dim), None])
        layer.in_proj_ba = ColumnParallelMergedLinear(hidden, ba.out_sizes, tp)
    else:  # rows per key head: a rank's slice is its key heads' q, k, v, z (b, a)
        layer.in_proj_qkvz, layer.in_proj_ba = _column_parallel(qkvz, tp), _column_parallel(ba, tp)
    layer.out_proj = RowParallelLinear(o.in_features, hidden, tp)
    layer.num_k_heads, layer.num_v_heads = k_heads, v_heads
    layer.channels = 2 * k_heads * layer.k_dim + v_heads * layer.v_dim
    device = conv.weight.device
    layer.conv1d = nn.Conv1d(layer.channels, layer.channels, conv.kernel_size[0], groups=layer.channels, bias=False,
                             device=device)
    layer.dt_bias = nn.Parameter(torch.empty(v_heads, device=device))
    layer.A_log = nn.Parameter(torch.empty(v_heads, device=device))


def _column_parallel(linear: nn.Linear, tp: TensorParallel) -> ColumnParallelLinear:
    return ColumnParallelLinear(linear.in_features, linear.out_features, tp, bias=linear.bias is not None)


def _split_mlp(mlp: GatedMLP, name: str, tp: TensorParallel) -> None:
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    tp.part(gate_up.out_sizes[0], f"{name}'s intermediate size")
    mlp.gate_up_proj = ColumnParallelMergedLinear(gate_up.in_features, gate_up.out_sizes, tp)
    mlp.down_proj = RowParallelLinear(down.in_features, down.out_features, tp, bias=down.bias is not None)
