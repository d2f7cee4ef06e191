"""The multi-token-prediction (MTP) module of Qwen3-Next and Qwen3.5-MoE checkpoints (`mtp.*`), loaded on request
(EngineConfig.mtp, --mtp): from the main model's hidden state at position p and the token at p + 1 it gives a draft
distribution of the token at p + 2.

The engine does not use it yet: it runs no speculative decoding, and no engine step runs this module (its KV cache
takes the engine's blocks beside the other layers', but no step writes it). It is for Python use through
model.mtp_logits (llm.engine.runner.model.mtp_logits with the LLM object, in a step context of the caller's);
wiring it into speculative decoding is a later step.

transformers' Qwen3Next and Qwen3_5Moe classes skip `mtp.*` (_keys_to_ignore_on_load_unexpected); the computation
here is the one vLLM (vllm/model_executor/models/qwen3_next_mtp.py Qwen3NextMultiTokenPredictor,
qwen3_5_mtp.py Qwen3_5MultiTokenPredictor) and SGLang (python/sglang/srt/models/qwen3_next_mtp.py
Qwen3NextForCausalLMMTP) run, read there and written anew here:
  - tensors: mtp.fc.weight [H, 2H] (no bias), mtp.pre_fc_norm_embedding.weight [H], mtp.pre_fc_norm_hidden.weight [H],
    mtp.layers.K.* (one decoder layer each, named as model.layers.N.* are) and mtp.norm.weight [H];
  - every norm is Qwen3-Next's RMSNorm that scales by 1 + weight (vLLM: GemmaRMSNorm as Qwen3NextRMSNorm; SGLang:
    GemmaRMSNorm);
  - h = fc(cat([pre_fc_norm_embedding(embed_tokens(token at p + 1)), pre_fc_norm_hidden(hidden at p)], -1)): the
    embedding first, then the hidden state;
  - the hidden state is the main model's output after its final norm (vLLM's Qwen3NextModel.forward and SGLang's
    return model.norm's output, and that is what their proposers hand the draft model), the one
    MoECausalLM.forward returns;
  - mtp.layers.K is a full-attention decoder layer (gated attention, as the main stack's full-attention layers),
    whatever layer_types says; its MLP is the sparse MoE block (routed experts plus the sigmoid-gated shared
    expert) where the main stack's rule (mlp_only_layers, decoder_sparse_step) makes layer index K sparse, as both
    decide it by K (vLLM: the layer index in the prefix mtp.layers.K; SGLang: a one-layer Qwen3NextModel); every
    release's config makes it sparse;
  - out = norm(layer(h, positions)); logits = lm_head(out): embed_tokens and lm_head are the main model's own
    (neither release stores MTP copies of them);
  - positions: the hidden state's position p, not p + 1 (vLLM's EAGLE proposer runs the draft at the target's
    positions with the input ids shifted by one); the layer's keys and values are written at p in the sequence's
    own KV slots (the same block table as the main model's layers).
Layer counts: Qwen3.5's config.json names mtp_num_hidden_layers (1 in the releases); Qwen3-Next's names none and its
checkpoints carry one layer (vLLM reads num_nextn_predict_layers, else 1): mtp_num_layers reads either, else 1.

A family carries it through MultiTokenPredictionMixin (Qwen3NextForCausalLM, and so Qwen3.5-MoE's classes): the
MTP layer K is MoE layer num_hidden_layers + K of the model's own ExpertBackend (vLLM numbers it so too), and the
loader hands its routed experts (mtp.layers.K.mlp.experts.*) to that backend as it hands the main layers': the torch
reference and the native engine keep a layer per index, and the hybrid GPU/CPU split places it with the others
(its plan is made from the model's moe_layers, which include it). Deferred experts are refused with it: their share
of the MTP layer would join a residual only after a following decoder layer, and it has none. What is keyed by the
MoE layers outside the model follows them: a packed-expert cache entry written without the MTP layer (or with it)
is packed again when mtp changes, and a converted directory holds no MTP experts (the load fails naming the layer).

T tokens, H hidden, V vocab.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from hybridmoe.errors import HybridMoEError
from hybridmoe.layers.norm import ZeroCenteredRMSNorm

MTP_FLAG = "hybridmoe_mtp"
"""The ModelConfig value enable_mtp sets: the model builds its MTP module and loads mtp.* (else it skips them)."""

DEFAULT_MTP_LAYERS = 1
"""MTP layers where config.json names none (Qwen3-Next's releases carry one; vLLM assumes one too)."""

MTP_EXPERT_PATTERN = re.compile(r"mtp\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
"""The MTP layers' routed-expert tensors (as vLLM and SGLang read them); groups: MTP layer, expert, projection."""


def mtp_num_layers(config) -> int:
    """The MTP layers config.json declares: mtp_num_hidden_layers (Qwen3.5's name), else num_nextn_predict_layers
    (vLLM's for Qwen3-Next), else DEFAULT_MTP_LAYERS."""
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        if config.get(key) is not None:
            return int(config.get(key))
    return DEFAULT_MTP_LAYERS


def enable_mtp(model_cls: type, config, deferred_experts: int = 0) -> None:
    """Mark config (a ModelConfig) so that model_cls builds and loads its MTP module; a HybridMoEError if the family
    has none, config.json declares no MTP layer, or experts are deferred."""
    if not getattr(model_cls, "has_mtp_module", False):
        raise HybridMoEError(f"mtp: {model_cls.__name__} has no multi-token-prediction module here; it loads for "
                             "Qwen3-Next and Qwen3.5-MoE checkpoints")
    if mtp_num_layers(config) < 1:
        raise HybridMoEError("mtp: config.json declares no multi-token-prediction layer (mtp_num_hidden_layers "
                             f"{mtp_num_layers(config)})")
    if deferred_experts:
        raise HybridMoEError(f"mtp: deferred_experts {deferred_experts} cannot run with the MTP layer (its deferred "
                             "share would join no residual); use deferred_experts 0")
    setattr(config, MTP_FLAG, True)


class MultiTokenPredictor(nn.Module):
    """fc over the normed embedding and hidden state, decoder layers, a final norm; checkpoint names under mtp.*.

    layers: the decoder layers, each called as layer(h [T, H], positions [T]) -> [T, H] with a full-attention
    mixer at .self_attn (GatedAttention: its paged KV cache is allocated here)."""

    def __init__(self, hidden_size: int, eps: float, layers: list[nn.Module]):
        super().__init__()
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(hidden_size, eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(hidden_size, eps)
        self.layers = nn.ModuleList(layers)
        self.norm = ZeroCenteredRMSNorm(hidden_size, eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                layer: int = 0) -> torch.Tensor:
        """embeds [T, H] (of the tokens after), hidden [T, H] (the main model's, final-normed), positions [T] (the
        hidden states') -> the MTP layer's final-normed output [T, H]; reads the step context for KV slots."""
        h = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        return self.norm(self.layers[layer](h, positions))

    def allocate_kv_blocks(self, num_blocks: int, block_size: int, slot_table: torch.Tensor | None = None,
                           quantized: bool = False) -> None:
        """Each layer's paged cache, laid out as the main model's layers' (one more full-attention layer each)."""
        for layer in self.layers:
            layer.self_attn.allocate_kv_cache(num_blocks, block_size, slot_table, quantized=quantized)

    def kv_bytes_per_token(self, quantized: bool = False) -> int:
        return sum(layer.self_attn.kv_bytes_per_token(quantized) for layer in self.layers)

    def kv_cache_tensors(self) -> list[torch.Tensor]:
        caches = [layer.self_attn.kv_cache for layer in self.layers]
        return [t for cache in caches if cache is not None for t in cache.tensors()]


class MultiTokenPredictionMixin:
    """What a MoECausalLM whose checkpoints carry mtp.* adds (a base class before MoECausalLM's subclass): its
    __init__ calls build_mtp; the MTP layers' experts, KV caches and tensors then join the model's own."""

    has_mtp_module = True
    """enable_mtp accepts this family."""

    def build_mtp(self, make_layer: Callable[[int], nn.Module]) -> None:
        """self.mtp: None (mtp.* skipped, nothing held) unless the config carries MTP_FLAG; else a
        MultiTokenPredictor of make_layer(K) for each MTP layer K (its MoE block the backend's layer
        num_hidden_layers + K, where is_moe_layer(K))."""
        self.mtp = None
        if self.config.get(MTP_FLAG):
            layers = [make_layer(k) for k in range(mtp_num_layers(self.config))]
            self.mtp = MultiTokenPredictor(self.config.hidden_size, self.config.rms_norm_eps, layers)

    def is_ignored(self, name: str) -> bool:
        """mtp.* unless the MTP module is built."""
        return (self.mtp is None and name.startswith("mtp.")) or super().is_ignored(name)

    @property
    def moe_layers(self) -> list[int]:
        """The decoder's MoE layers, then the MTP layers' (num_hidden_layers + K) when the MTP module is built."""
        if self.mtp is None:
            return super().moe_layers
        first = self.config.num_hidden_layers
        return super().moe_layers + [first + k for k in range(len(self.mtp.layers)) if self.is_moe_layer(k)]

    def expert_key(self, name: str) -> tuple[int, int, str] | None:
        """The decoder's routed-expert tensors, and the MTP layers' (layer num_hidden_layers + K) when built."""
        m = MTP_EXPERT_PATTERN.fullmatch(name) if self.mtp is not None else None
        if m is None:
            return super().expert_key(name)
        return self.config.num_hidden_layers + int(m.group(1)), int(m.group(2)), m.group(3)

    def expert_name(self, layer: int, expert: int, proj: str) -> str:
        k = layer - self.config.num_hidden_layers
        if k >= 0:
            return f"mtp.layers.{k}.mlp.experts.{expert}.{proj}_proj.weight"
        return super().expert_name(layer, expert, proj)

    def allocate_kv_blocks(self, num_blocks: int, block_size: int, slot_table: torch.Tensor | None = None,
                           quantized: bool = False) -> None:
        super().allocate_kv_blocks(num_blocks, block_size, slot_table, quantized)
        if self.mtp is not None:
            self.mtp.allocate_kv_blocks(num_blocks, block_size, slot_table, quantized)

    def kv_bytes_per_token(self, quantized: bool = False) -> int:
        mtp = self.mtp.kv_bytes_per_token(quantized) if self.mtp is not None else 0
        return super().kv_bytes_per_token(quantized) + mtp

    def kv_cache_tensors(self) -> list[torch.Tensor]:
        return super().kv_cache_tensors() + (self.mtp.kv_cache_tensors() if self.mtp is not None else [])

    def mtp_hidden(self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                   layer: int = 0) -> torch.Tensor:
        """hidden [T, H] (forward's output: final-normed) at positions [T], next_ids [T] (the token after each)
        -> MTP layer `layer`'s final-normed output [T, H] (what a further MTP step would take as its hidden). Run in
        the step context of those positions (forward_context.py): the layer writes its keys and values there and
        attends to its own cache of the sequence's earlier positions, which earlier calls must have filled."""
        if self.mtp is None:
            raise HybridMoEError("this model was loaded without its multi-token-prediction module; load it with "
                                 "mtp=True (--mtp)")
        return self.mtp(self.model.embed_tokens(next_ids), hidden, positions, layer)

    def mtp_logits(self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                   layer: int = 0) -> torch.Tensor:
        """The draft logits [T, V] float32 of the token after each of next_ids [T]: mtp_hidden, then lm_head."""
        return self.compute_logits(self.mtp_hidden(hidden, next_ids, positions, layer))
