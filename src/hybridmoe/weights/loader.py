"""Model directory -> a ready model: config, module tree, weights, and the routed experts' backend.

The model is built on the meta device (no memory, no random init), materialized empty on
the target device in the target dtype, then every parameter is filled from the checkpoint
exactly once. Routed-expert tensors never enter the model: each MoE layer's experts go to the
ExpertBackend, read from the checkpoint one expert at a time once the layer is complete (the native
engine and the hybrid split take them so, set_layer_experts: packed straight from the mapped file;
the torch reference gets them stacked into gate/up [E, I, H] and down [E, H, I] for set_layer;
GPTQ/AWQ int4 codes that the native int4 engine takes as they are go to set_layer_codes, never
through float). Each tensor's mapped pages are released once it is copied or packed, so the
checkpoint is never resident as a whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hybridmoe.config import EngineConfig
from hybridmoe.engine.llm_engine import max_model_len
from hybridmoe.errors import CheckpointError, HybridMoEError
from hybridmoe.experts.base import ExpertBackend
from hybridmoe.experts.streamed_prefill import attach as attach_prefill_streamer
from hybridmoe.experts.torch_ref import TorchExperts
from hybridmoe.layers.linear import MergedLinear
from hybridmoe.layers.mlp import get_activation
from hybridmoe.models.base import EXPERT_PROJS, ModelConfig, MoECausalLM
from hybridmoe.models.registry import load_config
from hybridmoe.system.auto import resolve_engine_config, uses_hybrid
from hybridmoe.system.expert_memory import check_expert_memory
from hybridmoe.weights.expert_cache import read_manifest
from hybridmoe.weights.expert_cache_policy import PackedExperts, plan_packed_experts
from hybridmoe.weights.gguf_model_dir import resolve_model_path
from hybridmoe.weights.int4_codes import Int4Codes
from hybridmoe.weights.native_format import check_int4_group
from hybridmoe.weights.quantized import open_checkpoint
from hybridmoe.weights.safetensors import SafetensorsCheckpoint

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PROGRESS_MIN_BYTES = 1 << 30  # a progress bar only for loads that take a noticeable time


@dataclass
class LoadedModel:
    model: MoECausalLM
    """In eval mode, on engine_config.device, in `dtype`, no gradients."""
    config: ModelConfig
    experts: ExpertBackend
    """Holds the routed experts of every MoE layer (model.experts is the same object)."""
    dtype: torch.dtype
    engine_config: EngineConfig
    """The options the load ran with, every "auto" resolved (what the reports print as the choices)."""


def resolve_dtype(requested: str, config: ModelConfig) -> torch.dtype:
    """"auto" -> the checkpoint's dtype (config.json dtype / torch_dtype; float32 if it names none)."""
    if requested != "auto":
        return _DTYPES[requested]
    name = config.checkpoint_dtype or "float32"
    name = str(name).removeprefix("torch.")
    if name not in _DTYPES:
        raise CheckpointError(
            f"config.json dtype {name!r} is not one we compute in; pass dtype= one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def make_expert_backend(engine_config: EngineConfig, config: ModelConfig, model_cls: type[MoECausalLM] | None = None,
                        dtype: torch.dtype | None = None) -> ExpertBackend:
    """The one place an ExpertBackend is chosen, from a resolved EngineConfig (system/auto.py).

    A GPU budget, gpu_experts_per_layer or deferred experts make it the hybrid split (planned from
    model_cls's tensor sizes in dtype); otherwise expert_backend alone decides.
    """
    act = get_activation(config.hidden_act)
    if engine_config.expert_backend == "native" and config.hidden_act not in ("silu", "swish"):
        raise HybridMoEError(f"expert_backend='native' runs SiLU experts only; this model uses {config.hidden_act!r}")
    if uses_hybrid(engine_config):
        return _hybrid_backend(engine_config, config, model_cls, dtype, act)
    if engine_config.expert_backend == "torch":
        return TorchExperts(act=act)
    return NativeLayers(_cpu_experts_class(), **_native_options(engine_config))


def _native_options(ec: EngineConfig) -> dict:
    """CpuExperts' packing options from a resolved EngineConfig."""
    return dict(format=ec.expert_format, group_size=ec.expert_group_size, threads=ec.cpu_threads,
                zero_points=bool(ec.expert_zero_points) and ec.expert_format == "int4")


def _cpu_experts_class():
    try:
        from hybridmoe.experts.cpu_experts import CpuExperts
    except ImportError as e:
        raise HybridMoEError(
            f"expert_backend='native' needs the native CPU expert engine, which is not available ({e}); "
            "use expert_backend='torch'") from None
    return CpuExperts


def _hybrid_backend(engine_config: EngineConfig, config: ModelConfig, model_cls, dtype, act) -> ExpertBackend:
    from hybridmoe.experts.hybrid import HybridExperts, TorchCpuLayer
    from hybridmoe.experts.placement import gpu_expert_format, placement_for

    top_k = config.num_experts_per_tok
    if engine_config.deferred_experts >= top_k:
        raise HybridMoEError(f"deferred_experts {engine_config.deferred_experts} must be below the model's "
                             f"{top_k} experts per token (at least one runs in its own layer)")
    plan, _ = placement_for(model_cls, config, dtype, engine_config)
    if engine_config.expert_backend == "native":
        cpu_layer = _NativeLayer(_cpu_experts_class(), **_native_options(engine_config))
    else:
        cpu_layer = lambda g, u, d: TorchCpuLayer(g, u, d, act)  # noqa: E731
    return HybridExperts(plan, engine_config.device, cpu_layer, act, engine_config.deferred_experts,
                         config.num_hidden_layers, gpu_format=gpu_expert_format(engine_config, dtype))


class _NativeLayer:
    """Builds one layer's CpuExperts with the engine options: from stacked tensors, or one expert at a time."""

    def __init__(self, cpu_experts_cls, **options):
        self._cls, self._options = cpu_experts_cls, options

    def __call__(self, gate_proj, up_proj, down_proj):
        return self._cls(gate_proj, up_proj, down_proj, **self._options)

    def from_experts(self, experts, num_experts: int):
        return self._cls.from_experts(experts, num_experts, **self._options)


class NativeLayers(ExpertBackend):
    """One native CpuExperts per MoE layer behind the model-wide ExpertBackend interface.

    Activations cross to the CPU (where the native engine keeps its packed weights) and the
    result comes back to the hidden state's device and dtype.
    """

    def __init__(self, cpu_experts_cls, **options):
        self._cls, self._options = cpu_experts_cls, options
        self._layers: dict[int, object] = {}
        self._out: dict[int, tuple[torch.device, torch.dtype]] = {}

    def set_layer(self, layer, gate_proj, up_proj, down_proj):
        self.adopt(layer, self._cls(gate_proj, up_proj, down_proj, **self._options))

    def set_layer_experts(self, layer, experts, num_experts: int):
        """The layer packed from (gate, up, down) of one expert at a time (CpuExperts.from_experts)."""
        self.adopt(layer, self._cls.from_experts(experts, num_experts, **self._options))

    def int4_codes_group(self) -> int | None:
        """The group size in which set_layer_codes takes int4 codes as they are; None: float only."""
        o = self._options
        return o["group_size"] if o["format"] == "int4" and o["zero_points"] else None

    def set_layer_codes(self, layer, gate_proj: Int4Codes, up_proj: Int4Codes, down_proj: Int4Codes):
        self.adopt(layer, self._cls.from_codes(gate_proj, up_proj, down_proj, threads=self._options["threads"]))

    def from_packed(self, state: dict):
        """One layer's CpuExperts over already-packed buffers (a converted directory or the expert cache)."""
        return self._cls.from_packed(state, threads=self._options["threads"])

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


def _expert_placement(engine_config: EngineConfig, dtype: torch.dtype) -> tuple[torch.device, torch.dtype]:
    # The native engine and the hybrid split read experts from CPU memory (the hybrid moves its GPU share
    # itself, so a whole layer is never staged on the GPU); the torch reference runs them where the model runs.
    if engine_config.expert_backend == "native" or uses_hybrid(engine_config):
        return torch.device("cpu"), dtype
    return torch.device(engine_config.device), dtype


def build_model(cls: type[MoECausalLM], config: ModelConfig, experts: ExpertBackend, dtype: torch.dtype,
                device: str | torch.device) -> MoECausalLM:
    """The module tree with uninitialized parameters on device (filled by load_weights)."""
    with torch.device("meta"):
        model = cls(config, experts)
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()
    model.requires_grad_(False)
    return model.eval()


def load_model(model_dir: str | Path, engine_config: EngineConfig | None = None) -> LoadedModel:
    """model_dir: a Hugging Face model directory (bf16/fp8/GPTQ/AWQ), a converted one, or a .gguf file."""
    engine_config = engine_config or EngineConfig()
    model_dir = resolve_model_path(model_dir, engine_config)
    cls, config = load_config(model_dir)
    max_model_len(config, engine_config)  # a max_model_len the model cannot take fails before the weights load
    dtype = resolve_dtype(engine_config.dtype, config)
    engine_config = resolve_engine_config(engine_config, config, dtype, model_dir)
    experts = make_expert_backend(engine_config, config, cls, dtype)
    model = build_model(cls, config, experts, dtype, engine_config.device)
    expert_device, expert_dtype = _expert_placement(engine_config, dtype)
    packed = _plan_packed(model_dir, engine_config, model, experts)  # a converted directory's own checks first
    if engine_config.expert_backend == "native" and packed.reads_checkpoint:
        _check_before_packing(engine_config, model, experts)
    with open_checkpoint(model_dir, config) as ckpt:
        load_weights(model, ckpt, expert_device, expert_dtype, load_experts=packed.reads_checkpoint)
    packed.finish(experts)
    engine_config = attach_prefill_streamer(experts, engine_config)  # the token count it measured, if any
    return LoadedModel(model=model, config=config, experts=experts, dtype=dtype, engine_config=engine_config)


def _check_before_packing(engine_config: EngineConfig, model: MoECausalLM, experts: ExpertBackend) -> None:
    """What would fail only after a long read: int4 groups that do not fit the experts, too little memory."""
    E, inter = model.expert_dims()
    hidden = model.config.hidden_size
    if engine_config.expert_format == "int4":
        check_int4_group(engine_config.expert_group_size, hidden, inter,
                         "set expert_group_size to {g} (--expert-group-size {g})",
                         "set expert_format to int8 (--expert-format int8)")
    on_gpu = experts.plan.on_gpu if uses_hybrid(engine_config) else (lambda layer: ())
    check_expert_memory(engine_config, [E - len(on_gpu(layer)) for layer in model.moe_layers], hidden, inter)


def _plan_packed(model_dir: Path, engine_config: EngineConfig, model: MoECausalLM, experts: ExpertBackend):
    if not uses_hybrid(engine_config):
        return plan_packed_experts(model_dir, engine_config, model, experts)
    # The hybrid packs only each layer's CPU share, which neither a converted directory nor the cache holds.
    if read_manifest(model_dir) is not None:
        raise HybridMoEError(f"{model_dir} holds experts packed for the CPU only; GPU experts and deferral need "
                             "the original checkpoint directory")
    return PackedExperts(True)


def _expected_params(model: MoECausalLM) -> dict[tuple[str, int | None], torch.Tensor]:
    """(parameter name, shard) -> the view of the parameter that one checkpoint tensor fills."""
    modules = dict(model.named_modules())
    targets = {}
    for name, param in model.named_parameters():
        owner = modules[name.rpartition(".")[0]]
        if isinstance(owner, MergedLinear):
            for shard in range(len(owner.out_sizes)):
                start, rows = owner.shard_rows(shard)
                targets[(name, shard)] = param.data.narrow(0, start, rows)
        else:
            targets[(name, None)] = param.data
    return targets


class _ExpertStacker:
    """Collects where each expert tensor of a MoE layer is and hands complete layers to the backend.

    A float tensor is read from the checkpoint only when its layer is complete, one expert at a time,
    and its mapped pages are released (ckpt.release) as soon as that expert is packed or copied: a
    backend with set_layer_experts (native engine, hybrid split, convert) packs straight from the mapped
    checkpoint, so a load holds the packed experts plus one expert's source, never a stacked copy of a
    layer. Other backends get the layer stacked into [E, I, H] / [E, H, I] buffers.
    """

    def __init__(self, model: MoECausalLM, ckpt, device: torch.device, dtype: torch.dtype):
        self.model, self.ckpt, self.device, self.dtype = model, ckpt, device, dtype
        self.num_experts, inter = model.expert_dims()
        hidden = model.config.hidden_size
        self.shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
        self.layers = set(model.moe_layers)
        # layer -> (expert, proj) -> the checkpoint name of a float tensor, or int4 codes (a view of `codes`)
        self.entries: dict[int, dict[tuple[int, str], str | Int4Codes]] = {}
        # layer -> proj -> every expert's int4 codes [E, N, ...], filled as they come
        self.codes: dict[int, dict[str, Int4Codes]] = {}
        self.done: set[int] = set()

    def accepts(self, layer: int, expert: int) -> bool:
        return layer in self.layers and 0 <= expert < self.num_experts

    def expected_shape(self, proj: str) -> tuple[int, int]:
        return self.shapes[proj]

    def add(self, layer: int, expert: int, proj: str, entry: str | Int4Codes) -> None:
        """entry: the checkpoint name of a float tensor, or int4 codes that the backend takes as they are
        when the whole layer comes so."""
        entries = self.entries.setdefault(layer, {})
        entries[(expert, proj)] = self._stacked(layer, expert, proj, entry) if isinstance(entry, Int4Codes) else entry
        if len(entries) == self.num_experts * len(EXPERT_PROJS):
            self._hand_over(layer, self.entries.pop(layer), self.codes.pop(layer, {}))
            self.done.add(layer)

    def _stacked(self, layer: int, expert: int, proj: str, codes: Int4Codes) -> Int4Codes:
        """codes copied into their place in the layer's stacked codes (made on first use): the engine takes a
        layer's codes stacked, and stacking them only once the layer is complete would hold them twice."""
        by_proj = self.codes.setdefault(layer, {})
        if proj not in by_proj:
            by_proj[proj] = Int4Codes(*(torch.empty(self.num_experts, *t.shape, dtype=t.dtype) for t in codes))
        slot = Int4Codes(*(t[expert] for t in by_proj[proj]))
        for dst, src in zip(slot, codes):
            dst.copy_(src)
        return slot

    def _hand_over(self, layer: int, entries: dict[tuple[int, str], str | Int4Codes],
                   codes: dict[str, Int4Codes]) -> None:
        backend, E = self.model.experts, self.num_experts
        if all(isinstance(v, Int4Codes) for v in entries.values()):
            backend.set_layer_codes(layer, *(codes[p] for p in EXPERT_PROJS))
            return
        # A layer partly in codes (desc_act) goes through float as a whole.
        experts = self._expert_weights(entries)
        if hasattr(backend, "set_layer_experts"):
            backend.set_layer_experts(layer, experts, E)
            return
        stacked = {p: torch.empty(E, *self.shapes[p], dtype=self.dtype, device=self.device) for p in EXPERT_PROJS}
        for e, weights in enumerate(experts):
            for p, w in zip(EXPERT_PROJS, weights):
                stacked[p][e].copy_(w)
        backend.set_layer(layer, *(stacked[p] for p in EXPERT_PROJS))

    def _expert_weights(self, entries: dict[tuple[int, str], str | Int4Codes]):
        """(gate, up, down) of each expert in turn, in the expert dtype; resumed only once the consumer is
        done with the last expert, which is when its checkpoint pages are released."""
        release = getattr(self.ckpt, "release", lambda name: None)
        for e in range(self.num_experts):
            sources = [entries[(e, p)] for p in EXPERT_PROJS]
            yield tuple((s.dequantize() if isinstance(s, Int4Codes) else self.ckpt.get(s)).to(self.dtype)
                        for s in sources)
            for s in sources:
                if isinstance(s, str):
                    release(s)

    def first_missing(self) -> str | None:
        for layer in sorted(self.layers - self.done):
            have = self.entries.get(layer, {})
            for expert in range(self.num_experts):
                for proj in EXPERT_PROJS:
                    if (expert, proj) not in have:
                        return self.model.expert_name(layer, expert, proj)
        return None


def load_weights(model: MoECausalLM, ckpt: SafetensorsCheckpoint, expert_device: torch.device,
                 expert_dtype: torch.dtype, load_experts: bool = True) -> None:
    """Fill every parameter and every MoE layer's experts from ckpt; any gap or leftover is an error.

    load_experts=False: the routed experts come packed from elsewhere; ckpt's expert tensors are skipped.
    """
    targets = _expected_params(model)
    stacker = _ExpertStacker(model, ckpt, expert_device, expert_dtype)
    release = getattr(ckpt, "release", lambda name: None)
    codes_group = getattr(model.experts, "int4_codes_group", lambda: None)()
    int4_codes = ckpt.int4_codes if codes_group and getattr(ckpt, "int4_group", None) == codes_group else None
    loaded: set[tuple[str, int | None]] = set()
    unexpected: list[str] = []
    names_by_file = ckpt.names_by_file()
    total = sum(len(n) for n in names_by_file.values())
    with tqdm(total=total, desc="loading weights", unit="tensor", leave=False,
              disable=ckpt.nbytes() < _PROGRESS_MIN_BYTES) as bar:
        for file, names in names_by_file.items():
            bar.set_postfix_str(file)
            for name in names:
                bar.update()
                if model.is_ignored(name):
                    continue
                key = model.expert_key(name)
                if key is not None and not load_experts:
                    continue
                if key is not None:
                    layer, expert, proj = key
                    if not stacker.accepts(layer, expert):
                        unexpected.append(name)
                        continue
                    _check_shape(name, ckpt.shape(name), stacker.expected_shape(proj))
                    codes = int4_codes(name) if int4_codes else None
                    if codes is not None:
                        release(name)  # its codes are converted: the source pages are done with
                    stacker.add(layer, expert, proj, name if codes is None else codes)
                    continue
                target_key = model.param_target(name)
                if target_key not in targets:
                    unexpected.append(name)
                    continue
                target = targets[target_key]
                _check_shape(name, ckpt.shape(name), tuple(target.shape))
                target.copy_(ckpt.get(name))
                release(name)
                loaded.add(target_key)
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(f"checkpoint tensor {unexpected[0]}{more} is not part of "
                              f"{type(model).__name__} with this config.json")
    missing = [k for k in targets if k not in loaded]
    if missing:
        name = model.checkpoint_name(*missing[0])
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint is missing tensor {name}{more}")
    missing_expert = stacker.first_missing() if load_experts else None
    if missing_expert is not None:
        raise CheckpointError(f"checkpoint is missing tensor {missing_expert}")


def _check_shape(name: str, got: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if tuple(got) != tuple(expected):
        raise CheckpointError(f"tensor {name} has shape {list(got)}, expected {list(expected)} from config.json")
