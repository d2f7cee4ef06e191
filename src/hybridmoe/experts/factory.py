"""The one place an ExpertBackend is built: from a resolved EngineConfig, the torch reference, the native CPU
engine (one CpuExperts per MoE layer) or the hybrid GPU/CPU split, each with the model's expert activation
(and, where the config declares them, the biases the loader hands over: gpt-oss).

Shapes: T tokens, H hidden, K experts per token, E experts, I expert intermediate size.
"""

from __future__ import annotations

from functools import partial

import torch

from hybridmoe.config import EngineConfig, uses_hybrid
from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.base import ExpertBackend
from hybridmoe.experts.cpu_experts import CpuExperts
from hybridmoe.experts.hybrid import HybridExperts, TorchCpuLayer
from hybridmoe.experts.placement import gpu_expert_format, placement_for
from hybridmoe.experts.torch_ref import TorchExperts
from hybridmoe.layers.mlp import get_activation
from hybridmoe.platform import native_engine_built


def make_expert_backend(engine_config: EngineConfig, config, model_cls: type | None = None,
                        dtype: torch.dtype | None = None) -> ExpertBackend:
    """The one place an ExpertBackend is chosen, from a resolved EngineConfig (system/auto.py), for a model of
    class model_cls (models/: a MoECausalLM) and its ModelConfig config.

    A GPU budget, gpu_experts_per_layer or deferred experts make it the hybrid split (planned from
    model_cls's tensor sizes in dtype); otherwise expert_backend alone decides.
    """
    act, glu = get_activation(config.hidden_act), config.get("expert_glu")
    if engine_config.expert_backend == "native" and glu is None and config.hidden_act not in ("silu", "swish"):
        raise HybridMoEError(f"expert_backend='native' runs SiLU experts only; this model uses {config.hidden_act!r}")
    if uses_hybrid(engine_config):
        return _hybrid_backend(engine_config, config, model_cls, dtype, act, glu)
    if engine_config.expert_backend == "torch":
        return TorchExperts(act=act, glu=glu)
    return NativeLayers(_cpu_experts_class(), glu=glu, **_native_options(engine_config))


def expert_extras(config) -> str | None:
    """What the model's routed experts add to act(gate x) * up x, for a message (gpt-oss: the clamped SwiGLU and
    biases); None: nothing. The native engine, the torch reference and the hybrid GPU/CPU split run them;
    converted directories and the packed-expert cache (which hold no biases) do not."""
    needs = []
    if config.get("expert_glu") is not None:
        needs.append(f"the {config.expert_glu.name} activation")
    if config.get("expert_bias"):
        needs.append("biases")
    return " and ".join(needs) or None


def _native_options(ec: EngineConfig) -> dict:
    """CpuExperts' packing options from a resolved EngineConfig."""
    return {"format": ec.expert_format, "group_size": ec.expert_group_size, "threads": ec.cpu_threads,
            "zero_points": bool(ec.expert_zero_points) and ec.expert_format == "int4"}


def _cpu_experts_class():
    if not native_engine_built():
        raise HybridMoEError("expert_backend='native' needs the native CPU expert engine, which is not built on "
                             "this install (hybridmoe._native does not import); use expert_backend='torch'")
    return CpuExperts


def _hybrid_backend(engine_config: EngineConfig, config, model_cls, dtype, act, glu) -> ExpertBackend:
    """The hybrid split; glu (the model's ClampedSwiGLU, or None) takes act's place on both sides."""
    top_k = config.num_experts_per_tok
    if engine_config.deferred_experts >= top_k:
        raise HybridMoEError(f"deferred_experts {engine_config.deferred_experts} must be below the model's "
                             f"{top_k} experts per token (at least one runs in its own layer)")
    plan, _ = placement_for(model_cls, config, dtype, engine_config)
    expert_act = glu if glu is not None else act
    if engine_config.expert_backend == "native":
        cpu_layer = _NativeLayer(_cpu_experts_class(), glu=glu, **_native_options(engine_config))
    else:
        cpu_layer = partial(TorchCpuLayer, act=expert_act)
    return HybridExperts(plan, engine_config.device, cpu_layer, expert_act, engine_config.deferred_experts,
                         config.num_hidden_layers, gpu_format=gpu_expert_format(engine_config, dtype))


class _NativeLayer:
    """Builds one layer's CpuExperts with the engine options: from stacked tensors, or one expert at a time; each
    with the model's expert activation (glu: None for SiLU, else a ClampedSwiGLU)."""

    def __init__(self, cpu_experts_cls, glu=None, **options):
        self.cls, self.glu, self.options = cpu_experts_cls, glu, options

    def __call__(self, gate_proj, up_proj, down_proj):
        return self.with_glu(self.cls(gate_proj, up_proj, down_proj, **self.options))

    def from_experts(self, experts, num_experts: int):
        return self.with_glu(self.cls.from_experts(experts, num_experts, **self.options))

    def with_glu(self, experts):
        if self.glu is not None:
            experts.set_glu(self.glu)
        return experts

    @property
    def format(self) -> str:
        return self.options["format"]


class NativeLayers(ExpertBackend):
    """One native CpuExperts per MoE layer behind the model-wide ExpertBackend interface.

    Activations cross to the CPU (where the native engine keeps its packed weights) and the
    result comes back to the hidden state's device and dtype. glu: the model's expert activation (None: SiLU),
    given to every layer's CpuExperts; biases come per layer (set_layer_biases).
    """

    def __init__(self, cpu_experts_cls, glu=None, **options):
        self._build = _NativeLayer(cpu_experts_cls, glu, **options)
        self._layers: dict[int, object] = {}
        self._out: dict[int, tuple[torch.device, torch.dtype]] = {}

    def set_layer(self, layer, gate_proj, up_proj, down_proj):
        self.adopt(layer, self._build(gate_proj, up_proj, down_proj))

    def set_layer_experts(self, layer, experts, num_experts: int):
        """The layer packed from (gate, up, down) of one expert at a time (CpuExperts.from_experts)."""
        self.adopt(layer, self._build.from_experts(experts, num_experts))

    def takes_fp8_codes(self) -> bool:
        """fp8 experts are packed from block-FP8 codes as they are (CpuExperts.from_experts)."""
        return self._build.format == "fp8"

    def takes_mxfp4_codes(self) -> bool:
        """mxfp4 experts are packed from MXFP4 codes as they are (CpuExperts.from_experts)."""
        return self._build.format == "mxfp4"

    def int4_codes_group(self, symmetric: bool = False) -> int | None:
        """The group size in which set_layer_codes takes int4 codes as they are; None: float only. Symmetric codes
        go into either int4 layout (zero points written out as 8 where the layer has them), codes with zero
        points only into a layer with zero points."""
        o = self._build.options
        return o["group_size"] if o["format"] == "int4" and (o["zero_points"] or symmetric) else None

    def set_layer_codes(self, layer, gate_proj, up_proj, down_proj):
        """The layer packed from int4 codes as they are (weights/int4_codes.py Int4Codes of each projection)."""
        options = self._build.options
        if options["zero_points"]:
            gate_proj, up_proj, down_proj = (p.with_zeros() for p in (gate_proj, up_proj, down_proj))
        self.adopt(layer, self._build.with_glu(self._build.cls.from_codes(gate_proj, up_proj, down_proj,
                                                                          threads=options["threads"])))

    def set_layer_biases(self, layer, gate_bias, up_bias, down_bias):
        """The layer's expert biases (gate/up [E, I], down [E, H]), after its experts."""
        self._layers[layer].set_biases(gate_bias, up_bias, down_bias)

    def from_packed(self, state: dict):
        """One layer's CpuExperts over already-packed buffers (a converted directory or the expert cache)."""
        return self._build.with_glu(self._build.cls.from_packed(state, threads=self._build.options["threads"]))

    def adopt(self, layer: int, experts) -> None:
        """Where every packed layer goes (set_layer, set_layer_experts, set_layer_codes, the cache)."""
        self._layers[layer] = experts

    def layer_experts(self, layer: int):
        return self._layers[layer]

    def layers(self):
        return sorted(self._layers)

    def submit(self, layer, hidden, topk_ids, topk_weights):
        x = hidden.to("cpu", torch.bfloat16 if hidden.dtype == torch.float16 else hidden.dtype)
        self._out[layer] = (hidden.device, hidden.dtype)
        self._layers[layer].submit(x, topk_ids.cpu(), topk_weights.float().cpu())

    def wait(self, layer):
        device, dtype = self._out.pop(layer)
        return self._layers[layer].wait().to(device, dtype)
