"""compressed-tensors checkpoints (quant_method "compressed-tensors", format "pack-quantized"): int4 weights packed
eight to an int32, as Kimi-K2-Thinking ships its routed experts.

A linear X [out, in] quantized symmetrically in groups of `group` input channels is stored as
  X.weight_packed int32 [out, ceil(in / 8)]  nibble j (low bits first) of word c holds input channel 8c + j, as the
                                             unsigned code u = q + 8 of the signed value q in -8..7
  X.weight_scale  float [out, in / group]
  X.weight_shape  int   [2]                  (out, in)
and W[o, i] = (u[o, i] - 8) * scale[o, i // group]. In groups of 32/64/128 that is the native int4 format without
zero points (symmetric: the same u - 8), the codes as stored (int4_codes): the engine computes with exactly the
checkpoint's weights, nothing goes through float. Tensors that no config group quantizes (Kimi-K2-Thinking's
attention, shared experts and dense layers) are plain float tensors and read as they are.

Only that variant is read; any other (another format such as float-quantized, other bits, asymmetric weights,
channel or block strategies, activation ordering, quantized activations or KV cache, sparsity, transforms)
fails with one line naming what is not supported.
"""

from __future__ import annotations

import torch

from hybridmoe.errors import CheckpointError
from hybridmoe.weights.gptq import unpack_cols
from hybridmoe.weights.int4_codes import INT4_GROUPS, Int4Codes
from hybridmoe.weights.packed_linears import PackedLinears

FORMAT = "pack-quantized"
_UNSUPPORTED_PARTS = {".weight_zero_point": "asymmetric weights (weight_zero_point)",
                      ".weight_g_idx": "activation ordering (weight_g_idx)"}


def _unsupported(what: str) -> CheckpointError:
    return CheckpointError(f"compressed-tensors checkpoint with {what} is not supported; supported: format "
                           f"{FORMAT!r}, symmetric int4 weights in groups of {', '.join(map(str, INT4_GROUPS))}")


def _group_weights(name: str, group) -> dict:
    """One config group's weight arguments, checked against the one variant read."""
    if not isinstance(group, dict):
        raise _unsupported(f"config group {name!r} given as {type(group).__name__}")
    if group.get("format") not in (None, FORMAT):
        raise _unsupported(f"format {group['format']!r} (config group {name!r})")
    for key in ("input_activations", "output_activations"):
        if group.get(key):
            raise _unsupported(f"quantized activations ({key} of config group {name!r})")
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise _unsupported(f"no weight quantization in config group {name!r}")
    if weights.get("type", "int") != "int":
        raise _unsupported(f"{weights['type']} weights")
    if weights.get("num_bits") != 4:
        raise _unsupported(f"{weights.get('num_bits')}-bit weights")
    if weights.get("strategy") != "group":
        raise _unsupported(f"the weight strategy {weights.get('strategy')!r}")
    if weights.get("symmetric") is not True:
        raise _unsupported("asymmetric weights (zero points)")
    if weights.get("group_size") not in INT4_GROUPS:
        raise _unsupported(f"group_size {weights.get('group_size')!r}")
    if weights.get("actorder") not in (None, "weight", "static"):
        raise _unsupported(f"activation ordering {weights['actorder']!r}")
    if weights.get("dynamic"):
        raise _unsupported("dynamic weight quantization")
    return weights


def config_groups(qc: dict, unsupported) -> dict:
    """A compressed-tensors quantization_config's config_groups, after checking that it quantizes weights only:
    no KV cache scheme, transforms or sparsity (unsupported(what) makes the error naming what is there)."""
    for key, what in (("kv_cache_scheme", "a quantized KV cache"), ("transform_config", "transforms"),
                      ("moe_sparsity_config", "expert sparsity")):
        if qc.get(key):
            raise unsupported(f"{what} ({key})")
    sparsity = qc.get("sparsity_config") or {}
    if not isinstance(sparsity, dict) or sparsity.get("format", "dense") != "dense":
        raise unsupported(f"sparsity {sparsity.get('format') if isinstance(sparsity, dict) else sparsity!r}")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise unsupported("no config_groups")
    return groups


def pack_quantized_group(quantization_config: dict) -> int:
    """The int4 group size of a compressed-tensors quantization_config, after checking that it is the one
    variant read (module doc); else a CheckpointError naming what is not."""
    qc = quantization_config
    if qc.get("format") != FORMAT:
        raise _unsupported(f"format {qc.get('format')!r}")
    sizes = {_group_weights(name, group)["group_size"] for name, group in config_groups(qc, _unsupported).items()}
    if len(sizes) > 1:
        raise _unsupported(f"config groups of different group sizes ({', '.join(map(str, sorted(sizes)))})")
    return sizes.pop()


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """int32 [out, ceil(in / 8)] -> the stored unsigned codes uint8 [out, in] (0..15)."""
    return unpack_cols(packed, 4)[:, :in_features].to(torch.uint8).contiguous()


class CompressedTensorsCheckpoint(PackedLinears):
    """A pack-quantized compressed-tensors checkpoint read as if its packed linears were float weights."""

    PARTS = (".weight_packed", ".weight_scale", ".weight_shape")

    def __init__(self, model_dir, quantization_config: dict):
        self.group_size = pack_quantized_group(quantization_config)
        self.int4_group = self.group_size
        """The group size in which int4_codes offers codes (every packed linear has it)."""
        self.int4_symmetric = True
        """int4_codes gives symmetric codes (no zero points: W = (code - 8) * scale)."""
        super().__init__(model_dir)
        for name in self._ckpt.file_of:
            for suffix, what in _UNSUPPORTED_PARTS.items():
                if name.endswith(suffix):
                    self._ckpt.__exit__(None, None, None)
                    raise _unsupported(f"{what}: {name}")

    def _shape_of(self, base: str) -> tuple[int, int]:
        name = base + ".weight_shape"
        if name not in self._ckpt.file_of:
            raise CheckpointError(f"compressed-tensors tensor {base}.weight_packed has no {name} beside it")
        shape = self._ckpt.get(name)
        if shape.numel() != 2 or shape.is_floating_point() or int(shape.min()) < 1:
            raise CheckpointError(f"{name} must hold two positive integers (out, in), got {shape.tolist()}")
        return int(shape[0]), int(shape[1])

    def shape(self, name: str) -> tuple[int, ...]:
        base = self._packed_base(name)
        return self._ckpt.shape(name) if base is None else self._shape_of(base)

    def int4_codes(self, name: str) -> Int4Codes | None:
        """The packed linear `name` (X.weight) as symmetric int4 codes (zeros None); None for a float tensor."""
        base = self._packed_base(name)
        if base is None:
            return None
        out_features, in_features = self._shape_of(base)
        scale_name = base + ".weight_scale"
        if scale_name not in self._ckpt.file_of:
            raise CheckpointError(f"compressed-tensors tensor {base}.weight_packed has no {scale_name} beside it")
        packed, scale = self._ckpt.get(base + ".weight_packed"), self._ckpt.get(scale_name)
        if packed.dtype != torch.int32 or tuple(packed.shape) != (out_features, -(-in_features // 8)):
            raise CheckpointError(f"{base}.weight_packed is {str(packed.dtype).removeprefix('torch.')} "
                                  f"{list(packed.shape)}, expected int32 [{out_features}, {-(-in_features // 8)}] "
                                  f"for weight_shape [{out_features}, {in_features}]")
        groups = in_features // self.group_size
        if (in_features % self.group_size or tuple(scale.shape) != (out_features, groups)
                or not scale.is_floating_point()):
            raise CheckpointError(f"{scale_name} is {str(scale.dtype).removeprefix('torch.')} {list(scale.shape)}, "
                                  f"expected float [{out_features}, {in_features} / {self.group_size}] for "
                                  f"weight_shape [{out_features}, {in_features}] in groups of {self.group_size}")
        scales = scale.float().contiguous()  # bf16/fp16 widen to float32 exactly
        return Int4Codes(unpack_int4(packed, in_features), scales, None)

    def get(self, name: str) -> torch.Tensor:
        """The tensor as the model sees it: a packed linear dequantized to float32 (q * scale as compressed-tensors
        computes it; exact for bf16/fp16 scales, whose products with q in -8..7 fit float32's 24 bits)."""
        codes = self.int4_codes(name)
        return self._ckpt.get(name) if codes is None else codes.dequantize()
