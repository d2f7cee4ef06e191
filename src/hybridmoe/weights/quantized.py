"""Which checkpoint reader a model directory needs, and the GPTQ/AWQ one.

- a GGUF model (a directory made by gguf_model_dir from a .gguf file): GGUFCheckpoint;
- config.json quantization_config quant_method "gptq" or "awq": QuantizedCheckpoint, which shows
  each packed linear (X.qweight, X.qzeros, X.scales[, X.g_idx]) as the float weight X.weight, so
  the model and the expert stacker see ordinary names; 4-bit tensors in groups of 32/64/128 in the
  plain channel order are also offered as codes (int4_codes), which the native int4 engine with
  zero points packs as they are; the rest (GPTQ desc_act's permuted g_idx, other group sizes or
  bits) goes through float;
- quant_method "compressed-tensors" (pack-quantized int4, Kimi-K2-Thinking's experts):
  CompressedTensorsCheckpoint (compressed_tensors.py), which likewise shows X.weight and offers codes;
- quant_method "mxfp4" (gpt-oss's fused experts): Mxfp4Checkpoint (mxfp4.py), which shows X_blocks + X_scales as
  the float fused tensor X and decodes it one expert at a time;
- anything else (bf16/fp16/fp32, DeepSeek block-FP8): SafetensorsCheckpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from hybridmoe.errors import CheckpointError
from hybridmoe.models.base import ModelConfig
from hybridmoe.weights.awq import awq_int4_codes, dequantize_awq
from hybridmoe.weights.compressed_fp8 import IGNORED_SUFFIXES, float_quantized_block
from hybridmoe.weights.compressed_fp8 import SCALE_SUFFIX as COMPRESSED_FP8_SCALE
from hybridmoe.weights.compressed_tensors import CompressedTensorsCheckpoint
from hybridmoe.weights.gptq import dequantize_gptq, gptq_int4_codes
from hybridmoe.weights.int4_codes import INT4_GROUPS, Int4Codes
from hybridmoe.weights.mxfp4 import Mxfp4Checkpoint
from hybridmoe.weights.packed_linears import PackedLinears
from hybridmoe.weights.safetensors import SafetensorsCheckpoint

_PACKED_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")
log = logging.getLogger("hybridmoe.weights")


def open_checkpoint(model_dir: str | Path, config: ModelConfig):
    """The checkpoint reader for model_dir; use it as a context manager."""
    if (Path(model_dir) / "gguf_source.json").is_file():
        # imported here: only GGUF models need the gguf package
        from hybridmoe.weights.gguf_checkpoint import GGUFCheckpoint

        return GGUFCheckpoint.from_model_dir(model_dir)
    qc = config.get("quantization_config") or {}
    method = qc.get("quant_method")
    if method in ("gptq", "awq"):
        return QuantizedCheckpoint(model_dir, qc)
    fp8_block = float_quantized_block(qc)
    if fp8_block is not None:
        return SafetensorsCheckpoint(model_dir, fp8_block=fp8_block, fp8_scale_suffix=COMPRESSED_FP8_SCALE,
                                     ignored_suffixes=IGNORED_SUFFIXES)
    if method == "compressed-tensors":
        return CompressedTensorsCheckpoint(model_dir, qc)
    if method == "mxfp4":
        return Mxfp4Checkpoint(model_dir)
    if method not in (None, "fp8"):
        raise CheckpointError(f"quantization_config quant_method {method!r} is not supported; supported: fp8 "
                              "(block), gptq, awq, compressed-tensors (pack-quantized int4, float-quantized fp8), mxfp4 (gpt-oss)")
    return SafetensorsCheckpoint(model_dir, fp8_block=tuple(qc.get("weight_block_size") or (128, 128)))


class QuantizedCheckpoint(PackedLinears):
    """A GPTQ or AWQ checkpoint read as if its packed linears were float weights."""

    PARTS = _PACKED_SUFFIXES

    def __init__(self, model_dir: str | Path, quantization_config: dict):
        qc = quantization_config
        self.method = qc["quant_method"]
        self.bits = int(qc.get("bits", 4))
        self.group_size = int(qc.get("group_size", 128))
        if self.method == "awq":
            if self.bits != 4 or str(qc.get("version", "gemm")).lower() != "gemm" or not qc.get("zero_point", True):
                raise CheckpointError(f"AWQ {qc.get('version')} with bits={self.bits}, zero_point="
                                      f"{qc.get('zero_point')} is not supported; only 4-bit GEMM with zero points")
        else:
            fmt = qc.get("checkpoint_format", "gptq")
            if fmt not in ("gptq", "gptq_v2"):
                raise CheckpointError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq or gptq_v2)")
            self.v1_zeros = fmt == "gptq"
        self.int4_group = self.group_size if self.bits == 4 and self.group_size in INT4_GROUPS else None
        """The group size in which int4_codes can offer codes; None: never (other bits or group size)."""
        self._float_noted = False
        super().__init__(model_dir)

    def shape(self, name: str) -> tuple[int, ...]:
        base = self._packed_base(name)
        if base is None:
            return self._ckpt.shape(name)
        rows, cols = self._ckpt.shape(base + ".qweight")
        if self.method == "awq":  # [in, out / 8]
            return cols * 8, rows
        return cols, rows * 32 // self.bits  # [in * bits / 32, out]

    def _parts(self, base: str) -> dict[str, torch.Tensor]:
        part = {s: self._ckpt.get(base + s) for s in _PACKED_SUFFIXES if base + s in self._ckpt.file_of}
        for s in (".qzeros", ".scales"):
            if s not in part:
                raise CheckpointError(f"{self.method.upper()} tensor {base}.qweight has no {base}{s} beside it")
        return part

    def int4_codes(self, name: str) -> Int4Codes | None:
        """The packed linear `name` (X.weight) as int4 codes, or None: then get(name) gives it in float."""
        base = self._packed_base(name)
        if base is None or self.int4_group is None:
            return None
        part = self._parts(base)
        if self.method == "awq":
            return awq_int4_codes(part[".qweight"], part[".qzeros"], part[".scales"], self.group_size)
        codes = gptq_int4_codes(part[".qweight"], part[".qzeros"], part[".scales"], part.get(".g_idx"),
                                self.group_size, self.v1_zeros)
        if codes is None and not self._float_noted:
            self._float_noted = True
            log.info("GPTQ %s has a permuted g_idx (desc_act): its MoE layer's experts go through float and are "
                     "re-quantized by the engine (int4 groups are contiguous runs of input channels)", name)
        return codes

    def get(self, name: str) -> torch.Tensor:
        base = self._packed_base(name)
        if base is None:
            return self._ckpt.get(name)
        part = self._parts(base)
        if self.method == "awq":
            return dequantize_awq(part[".qweight"], part[".qzeros"], part[".scales"], self.group_size)
        return dequantize_gptq(part[".qweight"], part[".qzeros"], part[".scales"], part.get(".g_idx"), self.bits,
                               self.group_size, self.v1_zeros)
