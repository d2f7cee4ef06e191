"""DeepSeek-V2 / V2-Lite / V2.5 (DeepseekV2ForCausalLM) and V3 / R1 / Kimi-K2 (DeepseekV3ForCausalLM).

Every layer: multi-head latent attention (layers/mla.py: low-rank q when q_lora_rank is set,
a compressed latent KV cache, YaRN with DeepSeek's mscales), then a dense gated MLP for the
first first_k_dense_replace layers and an MoE for the rest: n_shared_experts always-on
experts (one GatedMLP of n_shared_experts * moe_intermediate_size) plus the routed ones.

The two classes differ only where transformers' do:
- V2 routes by softmax, "greedy" or "group_limited_greedy" (topk_method), and never
  renormalises: transformers' V2 ignores norm_topk_prob (every released V2 sets it false).
  Its rotary dimensions are always interleaved pairs.
- V3 routes by sigmoid with "noaux_tc" and e_score_correction_bias whatever topk_method and
  scoring_func say (so does transformers), renormalising if norm_topk_prob; rotary pairs are
  interleaved unless rope_interleave is false.

T tokens, H hidden.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from hybridmoe.errors import CheckpointError
from hybridmoe.experts.base import ExpertBackend
from hybridmoe.layers.deepseek_routing import DeepseekRouter
from hybridmoe.layers.mla import MultiHeadLatentAttention
from hybridmoe.layers.mlp import GatedMLP
from hybridmoe.layers.yarn import complete_yarn
from hybridmoe.models.base import DecoderLayer, MoECausalLM

_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


class DeepseekMoE(nn.Module):
    """Routed experts (run by the ExpertBackend) plus the shared experts, summed."""

    takes_router_logits = True
    """forward(x, logits) takes the router's logits made by the caller (DecoderLayer's norm + router GEMV)."""

    def __init__(self, layer_idx: int, gate: DeepseekRouter, experts: ExpertBackend,
                 hidden_size: int, shared_intermediate_size: int, hidden_act: str):
        super().__init__()
        self.layer_idx, self.gate, self.experts = layer_idx, gate, experts
        if shared_intermediate_size:
            self.shared_experts = GatedMLP(hidden_size, shared_intermediate_size, hidden_act)

    def forward(self, x: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]; logits: the router's float32 logits [T, E] of x if already made.

        The shared experts run between the routed experts' submit and wait: on a GPU they then fill the
        time the stream waits for the CPU's routed experts instead of coming after it."""
        ids, weights = self.gate(x, logits)
        self.experts.submit(self.layer_idx, x, ids, weights)
        shared = self.shared_experts(x) if hasattr(self, "shared_experts") else None
        out = self.experts.wait(self.layer_idx)
        return out if shared is None else out + shared


def noaux_tc_router(c) -> DeepseekRouter:
    """V3's router (also GLM-4.5's): sigmoid scores plus e_score_correction_bias choose within the topk_group
    best of n_group groups; the unbiased scores weigh, renormalised if norm_topk_prob, times routed_scaling_factor."""
    return DeepseekRouter(c.hidden_size, c.n_routed_experts, c.num_experts_per_tok, scoring_func="sigmoid",
                          topk_method="noaux_tc", n_group=c.n_group, topk_group=c.topk_group,
                          norm_topk_prob=c.norm_topk_prob, routed_scaling_factor=c.routed_scaling_factor)


def deepseek_mlp(model: MoECausalLM, layer_idx: int) -> nn.Module:
    """A layer's MLP in DeepSeek's layout (GLM-4.5's too): on an MoE layer (model.is_moe_layer) the routed
    experts under model.make_router() plus one GatedMLP of n_shared_experts * moe_intermediate_size, else a
    dense GatedMLP of intermediate_size."""
    c = model.config
    if not model.is_moe_layer(layer_idx):
        return GatedMLP(c.hidden_size, c.intermediate_size, c.hidden_act)
    return DeepseekMoE(layer_idx, model.make_router(), model.experts, c.hidden_size,
                       c.moe_intermediate_size * (c.n_shared_experts or 0), c.hidden_act)


def is_beyond_last_layer(name: str, num_hidden_layers: int) -> bool:
    """A tensor of a layer past num_hidden_layers: the multi-token-prediction layer that V3/R1 and GLM-4.5
    checkpoints ship after the decoder stack, which next-token decoding never runs."""
    m = _LAYER_INDEX.match(name)
    return m is not None and int(m.group(1)) >= num_hidden_layers


class DeepseekV2ForCausalLM(MoECausalLM):
    config_defaults = {
        "vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "first_k_dense_replace": 0, "moe_layer_freq": 1, "n_routed_experts": 64,
        "n_shared_experts": 2, "num_experts_per_tok": None, "moe_intermediate_size": 1407,
        "topk_method": "greedy", "n_group": None, "topk_group": None, "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
    }

    # q/k/v are not fused here (MLA has no k_proj/v_proj); only the MLPs' gate and up are
    packed_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    @classmethod
    def finalize_config(cls, values: dict) -> None:
        values["rope_parameters"] = complete_yarn(values["rope_parameters"], values["max_position_embeddings"])
        if values.get("mlp_bias"):
            raise CheckpointError("DeepSeek checkpoints with mlp_bias=true are not supported")

    def is_moe_layer(self, layer_idx: int) -> bool:
        c = self.config
        # DeepSeek's own code also honours moe_layer_freq (transformers drops it; every release uses 1)
        return (bool(c.n_routed_experts) and layer_idx >= c.first_k_dense_replace
                and layer_idx % c.moe_layer_freq == 0)

    def expert_dims(self) -> tuple[int, int]:
        return self.config.n_routed_experts, self.config.moe_intermediate_size

    def make_router(self) -> DeepseekRouter:
        c = self.config
        return DeepseekRouter(c.hidden_size, c.n_routed_experts, c.num_experts_per_tok, scoring_func="softmax",
                              topk_method=c.topk_method, n_group=c.n_group, topk_group=c.topk_group,
                              norm_topk_prob=False, routed_scaling_factor=c.routed_scaling_factor)

    def rope_interleave(self) -> bool:
        return True

    def make_attention(self) -> nn.Module:
        """One layer's attention, called as attn(x [T, H], positions [T]) -> [T, H]."""
        c = self.config
        return MultiHeadLatentAttention(c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank,
                                        c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.rope_parameters,
                                        self.rope_interleave(), c.attention_bias)

    def make_layer(self, layer_idx: int) -> nn.Module:
        c = self.config
        return DecoderLayer(self.make_attention(), deepseek_mlp(self, layer_idx), c.hidden_size, c.rms_norm_eps)

    def is_ignored(self, name: str) -> bool:
        return is_beyond_last_layer(name, self.config.num_hidden_layers) or super().is_ignored(name)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    config_defaults = {
        **DeepseekV2ForCausalLM.config_defaults,
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61,
        "num_attention_heads": 128, "max_position_embeddings": 4096, "moe_intermediate_size": 2048,
        "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "n_group": 8,
        "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
        "rope_interleave": True,
    }

    def make_router(self) -> DeepseekRouter:
        return noaux_tc_router(self.config)

    def rope_interleave(self) -> bool:
        return self.config.rope_interleave
