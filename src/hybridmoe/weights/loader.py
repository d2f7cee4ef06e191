"""A checkpoint -> a built model's parameters and its routed experts' backend, each tensor read once.

Every parameter is filled from the checkpoint exactly once. Routed-expert tensors never enter the model:
each MoE layer's experts go to the ExpertBackend, read from the checkpoint one expert at a time once the
layer is complete (the native engine and the hybrid split take them so, set_layer_experts: packed straight
from the mapped file; the torch reference gets them stacked into gate/up [E, I, H] and down [E, H, I] for
set_layer; GPTQ/AWQ int4 codes that the native int4 engine takes as they are go to set_layer_codes, never
through float; block-FP8 codes that the native fp8 engine takes as they are go to set_layer_experts as Fp8Codes,
never through float); experts stored fused, one tensor per layer and part (gpt-oss), go through
weights/fused_experts.py (MXFP4 codes that the native mxfp4 engine takes as they are as Mxfp4Codes). Each
tensor's mapped pages are released once it is copied or packed, so the checkpoint is never resident as a whole.
engine/model_loader.py builds the model and chooses the backend first.

Every tensor the model or the backend receives is checked as it is read (checked_weight): a float dtype (the
readers hand quantized formats over dequantized or as Int4Codes, so an integer tensor here is a wrong file) and
no NaN or Inf, found by one min/max pass over its bytes (~30 GB/s), not a full-size mask. Block-FP8 codes handed
over as they are get their scales checked here and their codes by the native packer (a NaN code fails there).
"""

from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from hybridmoe.errors import CheckpointError
from hybridmoe.experts.fp8_codes import Fp8Codes
from hybridmoe.layers.linear import MergedLinear
from hybridmoe.models.base import EXPERT_PROJS, ModelConfig, MoECausalLM
from hybridmoe.weights.fused_experts import FusedExpertLayers
from hybridmoe.weights.int4_codes import Int4Codes
from hybridmoe.weights.safetensors import SafetensorsCheckpoint

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PROGRESS_MIN_BYTES = 1 << 30  # a progress bar only for loads that take a noticeable time


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


def checked_weight(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """tensor, if it is a float tensor without NaN or Inf; else a CheckpointError naming it."""
    if not tensor.is_floating_point():
        raise CheckpointError(f"tensor {name} has dtype {str(tensor.dtype).removeprefix('torch.')}, where a float "
                              "weight is expected")
    if tensor.numel():
        values = tensor if tensor.element_size() > 1 else tensor.float()  # FP8 has no min/max kernels
        low, high = (v.item() for v in values.aminmax())  # NaN anywhere makes both NaN
        if not (math.isfinite(low) and math.isfinite(high)):
            what = "NaN" if math.isnan(low) else "infinite values"
            raise CheckpointError(f"tensor {name} holds {what}; the checkpoint file is damaged")
    return tensor


def _check_codes(name: str, codes: Int4Codes) -> None:
    checked_weight(f"{name} (scales)", codes.scales)
    if codes.zeros is not None:
        checked_weight(f"{name} (zero points)", codes.zeros)


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
        self.layers = set(model.moe_layers) if model.fused_expert_pattern is None else set()  # else: fused ones
        # layer -> (expert, proj) -> the checkpoint name of a float tensor, or int4 codes (a view of `codes`)
        self.entries: dict[int, dict[tuple[int, str], str | Int4Codes]] = {}
        # layer -> proj -> every expert's int4 codes [E, N, ...], filled as they come
        self.codes: dict[int, dict[str, Int4Codes]] = {}
        self.done: set[int] = set()
        # name -> (codes, scale) of a block-FP8 tensor, where the backend takes those as they are
        self.fp8_codes = getattr(ckpt, "fp8_codes", None) if model.experts.takes_fp8_codes() else None

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
            by_proj[proj] = Int4Codes(*(None if t is None else torch.empty(self.num_experts, *t.shape, dtype=t.dtype)
                                        for t in codes))
        slot = Int4Codes(*(None if t is None else t[expert] for t in by_proj[proj]))
        for dst, src in zip(slot, codes):
            if dst is not None:
                dst.copy_(src)
        return slot

    def _hand_over(self, layer: int, entries: dict[tuple[int, str], str | Int4Codes],
                   codes: dict[str, Int4Codes]) -> None:
        backend, E = self.model.experts, self.num_experts
        if all(isinstance(v, Int4Codes) for v in entries.values()):
            backend.set_layer_codes(layer, *(codes[p] for p in EXPERT_PROJS))
            return
        # A layer partly in codes (desc_act) goes through float as a whole.
        backend.set_layer_experts(layer, self._expert_weights(entries), E)

    def _expert_weights(self, entries: dict[tuple[int, str], str | Int4Codes]):
        """(gate, up, down) of each expert in turn, in the expert dtype; resumed only once the consumer is
        done with the last expert, which is when its checkpoint pages are released."""
        release = getattr(self.ckpt, "release", lambda name: None)
        for e in range(self.num_experts):
            sources = [entries[(e, p)] for p in EXPERT_PROJS]
            yield tuple(self._weight(s) for s in sources)
            for s in sources:
                if isinstance(s, str):
                    release(s)

    def _weight(self, source: str | Int4Codes) -> torch.Tensor | Fp8Codes:
        """One expert matrix as the backend takes it: block-FP8 codes as stored where it takes those (their NaN
        codes are the packer's to refuse), else float in the expert dtype and device."""
        if isinstance(source, Int4Codes):
            return source.dequantize().to(self.device, self.dtype)
        stored = self.fp8_codes(source) if self.fp8_codes is not None else None
        if stored is not None:
            return Fp8Codes(stored[0], checked_weight(f"{source} (scales)", stored[1]), self.dtype)
        return checked_weight(source, self.ckpt.get(source)).to(self.device, self.dtype)

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
    fused = FusedExpertLayers(model, ckpt, expert_device, expert_dtype, checked_weight)
    release = getattr(ckpt, "release", lambda name: None)
    codes_group = model.experts.int4_codes_group(getattr(ckpt, "int4_symmetric", False))
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
                fused_key = model.fused_expert_key(name)
                if fused_key is not None:
                    if not fused.accepts(*fused_key):
                        unexpected.append(name)
                    elif load_experts:
                        _check_shape(name, ckpt.shape(name), fused.expected_shape(fused_key[1]))
                        fused.add(*fused_key, name)
                    continue
                if key is not None:
                    layer, expert, proj = key
                    if not stacker.accepts(layer, expert):
                        unexpected.append(name)
                        continue
                    _check_shape(name, ckpt.shape(name), stacker.expected_shape(proj))
                    codes = int4_codes(name) if int4_codes else None
                    if codes is not None:
                        _check_codes(name, codes)
                        release(name)  # its codes are converted: the source pages are done with
                    stacker.add(layer, expert, proj, name if codes is None else codes)
                    continue
                target_key = model.param_target(name)
                if target_key not in targets:
                    unexpected.append(name)
                    continue
                target = targets[target_key]
                _check_shape(name, ckpt.shape(name), tuple(target.shape))
                target.copy_(checked_weight(name, ckpt.get(name)))
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
    missing_expert = (stacker.first_missing() or fused.first_missing()) if load_experts else None
    if missing_expert is not None:
        raise CheckpointError(f"checkpoint is missing tensor {missing_expert}")


def _check_shape(name: str, got: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if tuple(got) != tuple(expected):
        raise CheckpointError(f"tensor {name} has shape {list(got)}, expected {list(expected)} from config.json")
