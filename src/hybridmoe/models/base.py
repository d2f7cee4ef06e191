"""What every model family shares: its config object, the decoder stack, and the weight-name contract.

A family subclasses MoECausalLM, fills in `config_defaults` (the HF config class's defaults)
and `make_layer`, and says which layers are MoE. The module tree mirrors the checkpoint
(model.embed_tokens, model.layers.N.*, model.norm, lm_head) so that most checkpoint names
are parameter names as they are; the exceptions are declared here, not in forward:
  - `packed_modules`: checkpoint modules loaded into a row range of a merged parameter
    (q/k/v -> qkv_proj, gate/up -> gate_up_proj);
  - `expert_pattern`: routed-expert tensors, which go to the ExpertBackend, not the model;
  - `is_ignored`: tensors a checkpoint may carry that the model has no use for.

Shapes: T tokens, H hidden, V vocab, E routed experts, I expert intermediate size.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from hybridmoe.config import DEFAULT_KV_BLOCK_SIZE
from hybridmoe.errors import CheckpointError
from hybridmoe.experts.base import ExpertBackend
from hybridmoe.layers.attention import contiguous_slot_table
from hybridmoe.layers.linear import decode_gemv, norm_linear
from hybridmoe.layers.norm import RMSNorm

EXPERT_PROJS = ("gate", "up", "down")


class ModelConfig:
    """config.json with the family's defaults filled in, read as attributes (config.hidden_size)."""

    def __init__(self, values: dict):
        self.__dict__.update(values)

    def get(self, name: str, default=None):
        return self.__dict__.get(name, default)

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"ModelConfig({self.__dict__!r})"


def normalize_rope(values: dict, default_theta: float) -> dict:
    """One rope dict {rope_type, rope_theta, ...} from either spelling of config.json.

    transformers 5 writes `rope_parameters` (with rope_theta inside); older checkpoints write
    `rope_theta` and `rope_scaling` (with "type" or "rope_type").
    """
    rope = dict(values.get("rope_parameters") or values.get("rope_scaling") or {})
    rope.setdefault("rope_type", rope.pop("type", "default"))
    if rope.get("rope_theta") is None:
        rope["rope_theta"] = values.get("rope_theta") or default_theta
    if rope["rope_type"] in ("yarn", "llama3", "longrope"):
        rope.setdefault("original_max_position_embeddings", values.get("max_position_embeddings"))
    return rope


def partial_rotary_dim(values: dict, default_factor: float) -> int:
    """The rotated dimensions of a head, head_dim * partial_rotary_factor: the factor in rope_parameters
    (transformers 5), else at config.json's top level (older files), else default_factor."""
    factor = values["rope_parameters"].get("partial_rotary_factor")
    if factor is None:
        factor = values.get("partial_rotary_factor")
    if factor is None:
        factor = default_factor
    rotary_dim = int(values["head_dim"] * factor)
    if rotary_dim < 2 or rotary_dim % 2:
        raise CheckpointError(f"head_dim {values['head_dim']} * partial_rotary_factor {factor} gives "
                              f"{rotary_dim} rotary dimensions; rotary needs an even number of at least 2")
    return rotary_dim


class DecoderLayer(nn.Module):
    """Pre-norm residual block: h += attn(norm(h)); h += mlp(norm(h)).

    mlp_name is the attribute the checkpoint uses for the MLP ("mlp"; Mixtral: "block_sparse_moe").
    fused_layer: in short steps on CUDA, each norm and the projection after it (the input norm and the
    attention's first projection (forward_normed), the post-attention norm with its residual add and the
    router of an MLP that takes_router_logits) run as one Triton GEMV (layers/linear.py norm_linear);
    else as the norm's kernel and cuBLAS.
    """

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float, mlp_name: str = "mlp"):
        super().__init__()
        self.self_attn = self_attn
        self.mlp_name = mlp_name
        setattr(self, mlp_name, mlp)
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.fused_layer = True  # fuse_decode_kernels switches it

    def forward(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        attn, mlp = self.self_attn, getattr(self, self.mlp_name)
        if self.fused_layer and hasattr(attn, "forward_normed"):  # the norm inside its first projection
            a = attn.forward_normed(h, self.input_layernorm, positions)
        else:
            a = attn(self.input_layernorm(h), positions)
        if getattr(mlp, "takes_router_logits", False) and decode_gemv(h, self.fused_layer, mlp.gate):
            logits, x, h = norm_linear(a, mlp.gate, self.post_attention_layernorm, residual=h)
            if getattr(mlp, "adds_residual", False):  # the add inside the MoE's last kernel
                return mlp(x, logits, residual=h)
            return h + mlp(x, logits)
        x, h = self.post_attention_layernorm(a, residual=h)  # h + a and its norm: one kernel on CUDA
        return h + mlp(x)


class MoECausalLM(nn.Module):
    """The model contract the loader and the engine rely on.

    forward(input_ids [T], positions [T]) -> hidden [T, H] (final norm applied), reading the
    step context (forward_context.py) for KV-cache slots; compute_logits(hidden [N, H]) ->
    [N, V] float32; allocate_kv_cache(num_slots, max_len) or allocate_kv_blocks before the first forward.
    """

    config_defaults: dict = {}
    """The HF config class's defaults, applied under config.json's own values."""

    config_aliases: dict = {}
    """Other spellings of a config key -> the name this family reads (HF attribute_map)."""

    default_rope_theta: float = 10000.0

    packed_modules: dict[str, tuple[str, int]] = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    """Checkpoint module name -> (merged module name, shard index in its rows)."""

    expert_pattern = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
    """Routed-expert checkpoint names; groups: layer, expert, and a name that expert_projs maps."""

    expert_projs: dict[str, str] = {"gate": "gate", "up": "up", "down": "down"}
    """expert_pattern's third group -> one of EXPERT_PROJS."""

    expert_name_format = "model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight"
    """Inverse of expert_pattern (proj spelled as the checkpoint spells it), for error messages."""

    fused_expert_pattern: re.Pattern | None = None
    """Routed experts stored fused, one tensor per MoE layer and part for all its experts (gpt-oss:
    mlp.experts.gate_up_proj [E, H, 2I], ...); groups: layer, part. None: one tensor per expert and projection
    (expert_pattern). fused_expert_shapes names the parts, split_fused_experts splits a layer's."""

    fused_expert_name_format = ""
    """Inverse of fused_expert_pattern, for error messages."""

    mxfp4_experts = False
    """Whether this family's checkpoints may store their fused experts as MXFP4 (quantization_config quant_method
    "mxfp4", read by weights/mxfp4.py), as gpt-oss's releases do; for any other family such a config is refused."""

    def __init__(self, config: ModelConfig, experts: ExpertBackend):
        super().__init__()
        self.config = config
        self.experts = experts
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleList(self.make_layer(i) for i in range(config.num_hidden_layers))
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with lm_head if tie_word_embeddings (again after to_empty, which unties)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def config_values(cls, raw: dict) -> dict:
        """config.json's dict with this family's aliases resolved and its defaults filled in (nothing derived)."""
        values = dict(raw)
        for alias, name in cls.config_aliases.items():
            if alias in values and name not in values:
                values[name] = values.pop(alias)
        return {**cls.config_defaults, **values}

    @classmethod
    def make_config(cls, raw: dict) -> ModelConfig:
        """config.json's dict -> ModelConfig with this family's defaults and normalizations."""
        values = cls.config_values(raw)
        values["rope_parameters"] = normalize_rope(values, cls.default_rope_theta)
        values["checkpoint_dtype"] = values.get("dtype") or values.get("torch_dtype")
        if values.get("num_key_value_heads") is None:
            values["num_key_value_heads"] = values["num_attention_heads"]
        if values.get("head_dim") is None and "num_attention_heads" in values:
            values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
        cls.finalize_config(values)
        return ModelConfig(values)

    @classmethod
    def finalize_config(cls, values: dict) -> None:
        """A family's own post-processing of config values (HF's __post_init__), in place."""

    def make_layer(self, layer_idx: int) -> nn.Module:
        """The decoder layer layer_idx: a module called as layer(h [T, H], positions [T]) -> [T, H]."""
        raise NotImplementedError

    def is_moe_layer(self, layer_idx: int) -> bool:
        raise NotImplementedError

    def expert_dims(self) -> tuple[int, int]:
        """(E, I): routed experts per MoE layer and their intermediate size."""
        raise NotImplementedError

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.config.num_hidden_layers) if self.is_moe_layer(i)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                hidden_states_out: list | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden [T, H].

        hidden_states_out, if given, receives the embeddings and each decoder layer's output
        (num_hidden_layers + 1 tensors [T, H], all before the final norm; HF's hidden_states
        are the same except the last, which HF gives after the final norm).
        """
        h = self.model.embed_tokens(input_ids)
        if hidden_states_out is not None:
            hidden_states_out.append(h)
        for i, layer in enumerate(self.model.layers):
            h = self.experts.after_layer(i, layer(h, positions))
            if hidden_states_out is not None:
                hidden_states_out.append(h)
        return self.model.norm(h)

    def fuse_decode_kernels(self, on: bool, layer: bool = True) -> None:
        """On CUDA with triton, run RMSNorm (with its residual add), attention's q/k norms + rotary +
        cache writes, the router's top-k and the hybrid experts' fixed-shape glue as one kernel each
        (on, the default), or as the torch ops they stand for (off: the reference the device tests
        hold them to; `benchmarks/decode.py gpu-ops` runs them side by side). layer (on by default): the
        fusions across a layer's ops (fused_layer): short steps' linear layers as the Triton decode GEMV,
        each with the norm before it (DecoderLayer), q/k norms + rotary + cache writes inside a short
        decode step's attention (Attention), MLA's decode step in one kernel (MultiHeadLatentAttention);
        only with on; layer saves 8.2 us a step per Qwen3 layer, 79.9 per DeepSeek-V2-Lite MoE layer (H200)."""
        layer = on and layer
        for module in [*self.modules(), self.experts]:
            if hasattr(module, "fused"):
                module.fused = on
            if hasattr(module, "fused_layer"):
                module.fused_layer = layer

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] float32."""
        return self.lm_head(hidden).float()

    def allocate_kv_cache(self, num_slots: int, max_len: int, block_size: int = DEFAULT_KV_BLOCK_SIZE,
                          quantized: bool = False) -> None:
        """Give every attention layer a cache of num_slots contiguous slots of max_len tokens (model dtype, or
        float8 when quantized; model device), which steps whose context carries no block table use: a single
        model run outside the engine; and every layer with a recurrent state one per slot (allocate_state)."""
        device = self.lm_head.weight.device
        table = contiguous_slot_table(num_slots, max_len, block_size, device)
        self.allocate_kv_blocks(table.numel(), block_size, table, quantized)
        self.allocate_state(num_slots)

    def state_bytes_per_seq(self) -> int:
        """Bytes of recurrent state one running sequence holds over every layer that keeps one instead of a KV cache
        (Gated DeltaNet's, layers/linear_attention.py); 0 for a model of attention layers only."""
        return sum(m.state_bytes() for m in self.model.layers.modules() if hasattr(m, "state_bytes"))

    def allocate_state(self, num_slots: int, num_snapshots: int = 0) -> None:
        """Give every layer that keeps a recurrent state one per slot (the slots of the step context's slot_ids),
        and num_snapshots snapshots of it beside them (the step context's state_saves and state_restores name them:
        prefix caching, engine/state_snapshots.py)."""
        for module in self.model.layers.modules():
            if hasattr(module, "allocate_state"):
                module.allocate_state(num_slots, num_snapshots)

    def recurrent_states(self) -> list:
        """The recurrent state allocate_state gave each layer that keeps one (layers/linear_attention.py's
        DeltaNetState), for a caller that runs a step's host share outside forward: the engine around a fixed-shape
        decode step, which a CUDA graph replays without running forward's Python."""
        return [m.state for m in self.model.layers.modules() if hasattr(m, "allocate_state") and m.state is not None]

    def kv_bytes_per_token(self, quantized: bool = False) -> int:
        """KV-cache bytes one token takes over every attention layer (in the model's dtype, or float8 with its
        scales when quantized)."""
        return sum(m.kv_bytes_per_token(quantized) for m in self.model.layers.modules()
                   if hasattr(m, "kv_bytes_per_token"))

    def kv_cache_tensors(self) -> list[torch.Tensor]:
        """Every attention layer's cache tensors ([NB, BS, ...]: keys and values, or MLA's latents, and their
        scales when quantized)."""
        out = []
        for m in self.model.layers.modules():
            cache = getattr(m, "kv_cache", None)
            if isinstance(cache, torch.Tensor):
                out += [cache, *([m.kv_scale] if m.kv_scale is not None else [])]
            elif cache is not None:
                out += cache.tensors()
        return out

    def allocate_kv_blocks(self, num_blocks: int, block_size: int, slot_table: torch.Tensor | None = None,
                           quantized: bool = False) -> None:
        """Give every attention layer a paged cache of num_blocks blocks of block_size positions (float8 when
        quantized); each step's context then carries the block table (the engine's, engine/kv_blocks.py), else
        slot_table is used."""
        for module in self.model.layers.modules():
            if hasattr(module, "allocate_kv_cache"):
                module.allocate_kv_cache(num_blocks, block_size, slot_table, quantized=quantized)

    def expert_key(self, name: str) -> tuple[int, int, str] | None:
        """(layer, expert, "gate"|"up"|"down") if name is a routed-expert tensor, else None."""
        m = self.expert_pattern.fullmatch(name)
        if m is None:
            return None
        return int(m.group(1)), int(m.group(2)), self.expert_projs[m.group(3)]

    def fused_expert_key(self, name: str) -> tuple[int, str] | None:
        """(layer, part) if name is a fused routed-expert tensor (fused_expert_pattern), else None."""
        m = self.fused_expert_pattern.fullmatch(name) if self.fused_expert_pattern is not None else None
        return (int(m.group(1)), m.group(2)) if m is not None else None

    def fused_expert_shapes(self) -> dict[str, tuple[int, ...]]:
        """Each fused part's shape in the checkpoint, for a family with fused_expert_pattern."""
        raise NotImplementedError

    def split_fused_experts(self, parts: dict[str, torch.Tensor]) -> tuple[tuple, tuple | None]:
        """The fused parts of n experts of a layer (the loader passes one expert at a time, n = 1) -> ((gate
        [n, I, H], up [n, I, H], down [n, H, I]), their biases (gate [n, I], up [n, I], down [n, H]) or None), as
        views: the loader copies them to the backend."""
        raise NotImplementedError

    def expert_name(self, layer: int, expert: int, proj: str) -> str:
        spelled = {v: k for k, v in self.expert_projs.items()}[proj]
        return self.expert_name_format.format(layer=layer, expert=expert, proj=spelled)

    def param_target(self, name: str) -> tuple[str, int | None]:
        """Checkpoint name -> (parameter name, shard index in a merged parameter or None)."""
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in self.packed_modules:
            merged, shard = self.packed_modules[parts[-2]]
            return ".".join(parts[:-2] + [merged, parts[-1]]), shard
        return name, None

    def checkpoint_name(self, param_name: str, shard: int | None) -> str:
        """Inverse of param_target: the checkpoint name that fills (param_name, shard)."""
        if shard is None:
            return param_name
        parts = param_name.split(".")
        for ckpt, (merged, s) in self.packed_modules.items():
            if parts[-2] == merged and s == shard:
                return ".".join(parts[:-2] + [ckpt, parts[-1]])
        raise KeyError(param_name)

    def is_ignored(self, name: str) -> bool:
        """Tensors a checkpoint may carry that this model does not use (not an error)."""
        if name.endswith("rotary_emb.inv_freq"):
            return True
        return bool(self.config.tie_word_embeddings) and name == "lm_head.weight"
