"""Qwen3-Next (Qwen3NextForCausalLM: Qwen3-Next-80B-A3B-Instruct / -Thinking).

Layers follow config.json's layer_types (else every full_attention_interval-th layer is full attention, the others
linear attention, as transformers derives them):
  - "linear_attention": Gated DeltaNet (layers/linear_attention.py): a recurrent state per sequence instead of a KV
    cache, held in slots beside the paged cache of the attention layers (MoECausalLM.allocate_state);
  - "full_attention": grouped-query attention with a sigmoid output gate, per-head q/k norms and rotary over the
    first head_dim * partial_rotary_factor dimensions of each head (layers/gated_attention.py).
Then, where mlp_only_layers and decoder_sparse_step say so, Qwen2-MoE's sparse block: softmax top-k routing
(renormalized with norm_topk_prob) plus one shared expert gated per token by sigmoid(shared_expert_gate x); else a
dense gated MLP. Every RMSNorm of the decoder (the layers' two, the final one, q/k norms) scales by 1 + weight, its
weight stored centred on zero; the DeltaNet output norm scales by its weight.

Released checkpoints carry the multi-token-prediction module under `mtp.*`: loading skips it, unless the config is
marked for it (models/mtp.py enable_mtp: EngineConfig.mtp, --mtp); then the model builds it (self.mtp, its layer K
MoE layer num_hidden_layers + K of the expert backend, with its own paged KV cache) and mtp_logits runs it. The
engine does not use it yet (no speculative decoding).

The recurrent state shapes how the engine runs this family (engine/model_runner.py, engine/state_snapshots.py): a
reused prefix needs the state where it ends besides its cached KV blocks, so prefix caching keeps snapshots of the
states at some block boundaries (a prompt's last full block, a sequence's latest one) and reuses a prefix up to its
last block with one; decode steps run in fixed shapes and as CUDA graphs as other families' do (the step updates its
rows' states in place by slot, its padding rows on a spare slot), but no step is launched ahead of the one before
it (one dropped would have advanced the states).

T tokens, H hidden.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridmoe.errors import CheckpointError
from hybridmoe.experts.base import ExpertBackend
from hybridmoe.layers.gated_attention import GatedAttention
from hybridmoe.layers.linear_attention import GatedDeltaNet
from hybridmoe.layers.mlp import GatedMLP
from hybridmoe.layers.norm import ZeroCenteredRMSNorm
from hybridmoe.models.base import partial_rotary_dim
from hybridmoe.models.mtp import MultiTokenPredictionMixin
from hybridmoe.models.qwen_moe import Qwen2MoeSparseMoeBlock, _QwenMoeForCausalLM

DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25
"""transformers' Qwen3NextConfig rotates a quarter of each head when config.json names no factor."""

DEFAULT_FULL_ATTENTION_INTERVAL = 4
"""transformers' Qwen3NextConfig: without layer_types, every fourth layer is full attention."""


class Qwen3NextDecoderLayer(nn.Module):
    """h += mixer(norm(h)); h += mlp(norm(h)), with the checkpoint's names: the mixer is `linear_attn` or
    `self_attn`. The norms are zero-centred, so none folds into a fused decode kernel (DecoderLayer's)."""

    def __init__(self, mixer_name: str, mixer: nn.Module, mlp: nn.Module, hidden_size: int, eps: float):
        super().__init__()
        self.mixer_name = mixer_name
        setattr(self, mixer_name, mixer)
        self.mlp = mlp
        self.input_layernorm = ZeroCenteredRMSNorm(hidden_size, eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(hidden_size, eps)

    def forward(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        a = getattr(self, self.mixer_name)(self.input_layernorm(h), positions)
        x, h = self.post_attention_layernorm(a, residual=h)
        if getattr(self.mlp, "adds_residual", False):
            return self.mlp(x, residual=h)
        return h + self.mlp(x)


class Qwen3NextForCausalLM(MultiTokenPredictionMixin, _QwenMoeForCausalLM):
    """Qwen-MoE's layer plan (is_moe_layer, expert_dims) with Qwen3-Next's token mixers and norms; the MTP module
    where the config asks for it (MultiTokenPredictionMixin)."""

    config_defaults = {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 48,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "hidden_act": "silu",
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "attention_bias": False, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "decoder_sparse_step": 1, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
        "num_experts_per_tok": 10, "num_experts": 512, "norm_topk_prob": True, "mlp_only_layers": None,
        "layer_types": None, "full_attention_interval": DEFAULT_FULL_ATTENTION_INTERVAL,
    }

    flat_projections = False
    """The Gated DeltaNet's input projections as one row block per key head (in_proj_qkvz, in_proj_ba); Qwen3.5's
    split ones are flat (layers/linear_attention.py)."""

    def __init__(self, config, experts: ExpertBackend | None):
        super().__init__(config, experts)
        self.model.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.build_mtp(lambda k: self._decoder_layer("full_attention", config.num_hidden_layers + k,
                                                     self.is_moe_layer(k)))

    @classmethod
    def finalize_config(cls, values: dict) -> None:
        """mlp_only_layers and layer_types as transformers fills them in; rotary_dim from partial_rotary_factor
        (in rope_parameters, else at the top level, else a quarter); the value heads a multiple of the key heads."""
        values["mlp_only_layers"] = values["mlp_only_layers"] or []
        if values["layer_types"] is None:
            every = values["full_attention_interval"]
            values["layer_types"] = ["linear_attention" if (i + 1) % every else "full_attention"
                                     for i in range(values["num_hidden_layers"])]
        values["rotary_dim"] = partial_rotary_dim(values, DEFAULT_PARTIAL_ROTARY_FACTOR)
        k_heads, v_heads = values["linear_num_key_heads"], values["linear_num_value_heads"]
        if v_heads % k_heads:
            raise CheckpointError(f"linear_num_value_heads {v_heads} must be a multiple of linear_num_key_heads "
                                  f"{k_heads} (each key head serves the same number of value heads)")

    def make_layer(self, layer_idx: int) -> nn.Module:
        return self._decoder_layer(self.config.layer_types[layer_idx], layer_idx, self.is_moe_layer(layer_idx))

    def _decoder_layer(self, kind: str, moe_layer: int, sparse: bool) -> Qwen3NextDecoderLayer:
        """A decoder layer with a mixer of kind ("linear_attention" or "full_attention") and the sparse MoE block
        (its routed experts the backend's layer moe_layer) if sparse, else the dense MLP."""
        c = self.config
        if kind == "linear_attention":
            name = "linear_attn"
            mixer = GatedDeltaNet(c.hidden_size, c.linear_num_key_heads, c.linear_num_value_heads,
                                  c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim,
                                  c.rms_norm_eps, c.hidden_act, flat_projections=self.flat_projections)
        else:
            name = "self_attn"
            mixer = GatedAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                   c.rope_parameters, bias=c.attention_bias, norm_eps=c.rms_norm_eps,
                                   rotary_dim=c.rotary_dim)
        if sparse:
            mlp = Qwen2MoeSparseMoeBlock(moe_layer, c, self.experts)
        else:
            mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act)
        return Qwen3NextDecoderLayer(name, mixer, mlp, c.hidden_size, c.rms_norm_eps)

    def _hand_prefetch_targets(self, experts: ExpertBackend) -> None:
        """For each MoE layer, the next layer's first projections and its router (ExpertBackend.prefetch_during)."""
        layers = self.model.layers
        for i in range(len(layers) - 1):
            if self.is_moe_layer(i):
                nxt = layers[i + 1]
                mixer = getattr(nxt, nxt.mixer_name)
                first = ([mixer.in_proj_qkvz, mixer.in_proj_ba] if nxt.mixer_name == "linear_attn"
                         else [mixer.qkv_proj, mixer.o_proj])
                gate = getattr(nxt.mlp, "gate", None)
                experts.prefetch_during(i, first + ([gate] if isinstance(gate, nn.Linear) else []))
