"""expert_format "auto": routed experts go to the native engine in the format nearest the checkpoint's own.

    GGUF Q8_0, Q5_*, Q6_K (and Q8_1/Q8_K)              -> int8
    GGUF Q4_0, Q4_1, Q4_K, IQ4_*                       -> int4, groups of 32 (their blocks)
    GGUF Q3_K, Q2_K, IQ3/IQ2/IQ1 (blocks of 16 or 32)  -> int4, groups of 32 (the finest the engine has)
    GPTQ / AWQ 4-bit (and 2/3-bit GPTQ)                -> int4 in the checkpoint's group size if it is 32, 64
                                                          or 128, else 128; 4-bit with zero
                                                          points (expert_zero_points None -> on), so the
                                                          codes load as they are (weights/int4_codes.py)
    compressed-tensors pack-quantized int4 (symmetric) -> int4 in the checkpoint's group size (32, 64 or 128),
                                                          with zero points (all 8), so the codes load as they are
    GPTQ 8-bit                                         -> int8
    block-FP8 e4m3 in 128x128 blocks (DeepSeek-V3)     -> fp8, its codes and scales as they are (experts/fp8_codes.py)
    MXFP4 (gpt-oss's safetensors releases)             -> mxfp4, its codes and scales as they are
                                                          (experts/mxfp4_codes.py)
    GGUF F32/F16/BF16, safetensors (bf16/fp16/fp32, FP8 in other blocks)  -> bf16
    GGUF MXFP4 (gpt-oss)                               -> bf16, which holds every MXFP4 value exactly (GGUF stores
                                                          the values doubled under a halved scale, its nibbles in
                                                          another order: decoded by gguf.quants, not read as codes)
    a `hybridmoe convert`ed directory                  -> the format and group size it was packed in
A GGUF that mixes types across its expert tensors (Q4_K_M keeps some down projections in Q6_K) takes
the format that most expert weights map to; a tie goes to the more precise one.
expert_group_size None (unset) takes the checkpoint's int4 group size from this table whenever the experts
end up int4, auto or chosen (`convert` does the same); a group size given is kept.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

from hybridmoe.config import DEFAULT_EXPERT_GROUP_SIZE, EngineConfig
from hybridmoe.errors import CheckpointError, HybridMoEError
from hybridmoe.experts.fp8_codes import FP8_BLOCK
from hybridmoe.weights.compressed_fp8 import float_quantized_block
from hybridmoe.weights.compressed_tensors import pack_quantized_group
from hybridmoe.weights.expert_cache import read_manifest
from hybridmoe.weights.gguf_names import expert_tensor
from hybridmoe.weights.int4_codes import INT4_GROUPS

log = logging.getLogger("hybridmoe.weights")

_PRECISION = {"bf16": 2, "int8": 1, "int4": 0}
_INT8_TYPES = {"Q8_0", "Q8_1", "Q8_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K"}
_INT4_TYPES = {"Q4_0", "Q4_1", "Q4_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_XXS", "IQ2_XS",
               "IQ2_S", "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0"}
_BF16_TYPES = {"F32", "F16", "BF16", "F64", "MXFP4"}
INT4_GGUF_GROUP = 32
"""Q4_0/Q4_1 blocks and Q4_K sub-blocks hold 32 weights; the smaller blocks of Q3_K/Q2_K round up to it."""


def gguf_type_format(type_name: str) -> str:
    """The native format nearest one GGUF tensor type (by its GGMLQuantizationType name)."""
    if type_name in _INT8_TYPES:
        return "int8"
    if type_name in _INT4_TYPES:
        return "int4"
    if type_name in _BF16_TYPES:
        return "bf16"
    return "int8"  # a type newer than this table: int8 loses the least of whatever it holds


def _from_gguf(model_dir: Path) -> tuple[str, int | None, str]:
    # imported here: only GGUF models need the gguf package
    from hybridmoe.weights.gguf_file import GGUFFiles

    source = json.loads((model_dir / "gguf_source.json").read_text())
    gguf = GGUFFiles(source["files"][0])
    weights: dict[str, int] = {}  # format -> expert weights that map to it
    types: dict[str, int] = {}
    for name, (tensor, _) in gguf.tensors.items():
        if expert_tensor(name) is None:
            continue
        kind = tensor.tensor_type.name
        fmt = gguf_type_format(kind)
        weights[fmt] = weights.get(fmt, 0) + int(tensor.n_elements)
        types[kind] = types.get(kind, 0) + 1
    if not weights:
        return "bf16", None, "a GGUF file without routed-expert tensors"
    fmt = max(weights, key=lambda f: (weights[f], _PRECISION[f]))
    seen = ", ".join(f"{k} x{n}" for k, n in sorted(types.items()))
    return fmt, INT4_GGUF_GROUP if fmt == "int4" else None, f"GGUF experts ({seen})"


def _qc_int(qc: dict, key: str, default: int) -> int:
    """quantization_config[key] as a positive integer (GPTQ writes group_size -1 for one group per row)."""
    value = qc.get(key, default)
    if type(value) is not int or (value < 1 and not (key == "group_size" and value == -1)):
        raise CheckpointError(f"config.json's quantization_config.{key} must be a positive integer, got {value!r}")
    return value


def block_fp8_block(qc: dict) -> tuple[int, int] | None:
    """The (rows, columns) of an FP8 e4m3 checkpoint's scale blocks, 0 spanning a whole dimension (quant_method
    "fp8", or compressed-tensors' float-quantized format: weights/compressed_fp8.py), None for any other
    checkpoint."""
    compressed = float_quantized_block(qc)
    if compressed is not None:
        return compressed
    if qc.get("quant_method") != "fp8" or qc.get("fmt", "e4m3") != "e4m3":
        return None
    return tuple(qc.get("weight_block_size") or (FP8_BLOCK, FP8_BLOCK))


def _block_text(block: tuple[int, int]) -> str:
    return {(1, 0): "FP8 e4m3 with a scale per output channel", (0, 0): "FP8 e4m3 with one scale per tensor"}.get(
        block, f"block-FP8 e4m3 in {block[0]}x{block[1]} blocks")


def _from_quantization_config(qc: dict) -> tuple[str, int | None, str] | None:
    method = qc.get("quant_method")
    block = block_fp8_block(qc)
    if block is not None:
        if block == (FP8_BLOCK, FP8_BLOCK):
            return "fp8", None, f"block-FP8 e4m3 in {FP8_BLOCK}x{FP8_BLOCK} blocks"
        return "bf16", None, (f"{_block_text(block)} (the native fp8 format's are {FP8_BLOCK}x{FP8_BLOCK} blocks)")
    if method == "mxfp4":
        return "mxfp4", None, "MXFP4 (e2m1 codes, an e8m0 scale per 32)"
    if method == "compressed-tensors":
        group = pack_quantized_group(qc)
        return "int4", group, f"compressed-tensors int4 g{group}"
    if method not in ("gptq", "awq"):
        return None
    bits, group = _qc_int(qc, "bits", 4), _qc_int(qc, "group_size", 128)
    fmt = "int8" if bits == 8 else "int4"
    return fmt, group if fmt == "int4" and group in INT4_GROUPS else None, f"{method.upper()} {bits}-bit g{group}"


def source_expert_format(model_dir: str | Path, config) -> tuple[str, int | None, str]:
    """(native format, int4 group size or None for "none of the engine's", what the source is)."""
    model_dir = Path(model_dir)
    manifest = read_manifest(model_dir)
    if manifest is not None:
        return manifest["format"], manifest["group_size"], "converted directory"
    if (model_dir / "gguf_source.json").is_file():
        return _from_gguf(model_dir)
    found = _from_quantization_config(config.get("quantization_config") or {})
    return found or ("bf16", None, "float weights")


def _zero_points(engine_config: EngineConfig, config) -> bool:
    """expert_zero_points, None resolved: int4 experts from a GPTQ/AWQ 4-bit or compressed-tensors int4 checkpoint
    keep its zero points."""
    if engine_config.expert_zero_points is not None:
        return engine_config.expert_zero_points
    qc = config.get("quantization_config") or {}
    if engine_config.expert_format != "int4":
        return False
    if qc.get("quant_method") == "compressed-tensors":
        return False  # its symmetric int4 codes are the native symmetric int4's (W = (code - 8) * scale)
    return qc.get("quant_method") in ("gptq", "awq") and _qc_int(qc, "bits", 4) == 4


def resolve_expert_format(engine_config: EngineConfig, config, model_dir: str | Path) -> EngineConfig:
    """engine_config with expert_format "auto" replaced by the source's nearest native format (logged),
    expert_group_size None by the source's int4 groups where the experts are int4 and the source has them (else
    DEFAULT_EXPERT_GROUP_SIZE), and expert_zero_points None by its choice (on for int4 from GPTQ/AWQ 4-bit,
    whose codes then load as they are)."""
    chosen = engine_config.expert_format
    resolved = engine_config
    if chosen == "auto" or (chosen == "int4" and engine_config.expert_group_size is None):
        fmt, group, source = source_expert_format(model_dir, config)
        if chosen == "auto":
            resolved = replace(resolved, expert_format=fmt)
        if resolved.expert_format == fmt == "int4" and resolved.expert_group_size is None:
            resolved = replace(resolved, expert_group_size=group)
    if resolved.expert_group_size is None:
        resolved = replace(resolved, expert_group_size=DEFAULT_EXPERT_GROUP_SIZE)
    resolved = replace(resolved, expert_zero_points=_zero_points(resolved, config))
    if chosen == "auto" and engine_config.expert_backend != "torch":
        group_note = f" g{resolved.expert_group_size}" if fmt == "int4" else ""
        zero_note = " with zero points" if resolved.expert_zero_points else ""
        log.info("routed experts: %s%s%s in the native engine, nearest to the checkpoint's %s "
                 "(set expert_format to choose)", fmt, group_note, zero_note, source)
    return resolved


def fitting_int4_group(group: int, hidden: int, inter: int) -> int | None:
    """group if int4 groups of it divide both sizes, else the largest group size that does (None: none)."""
    if hidden % group == 0 and inter % group == 0:
        return group
    return max((g for g in INT4_GROUPS if hidden % g == 0 and inter % g == 0), default=None)


def check_int4_group(group: int, hidden: int, inter: int, group_fix: str, format_fix: str) -> None:
    """int4 groups are runs of `group` input channels: of gate/up (hidden) and of down (inter), so the group
    must divide both. Else one line that names the fix: group_fix.format(g=a group size that divides both),
    or format_fix where none does."""
    fit = fitting_int4_group(group, hidden, inter)
    if fit == group:
        return
    fix = group_fix.format(g=fit) if fit else f"{format_fix} (no int4 group size divides both)"
    raise HybridMoEError(f"int4 in groups of {group} needs the hidden size ({hidden}) and the experts' intermediate "
                         f"size ({inter}) divisible by the group: {fix}")
