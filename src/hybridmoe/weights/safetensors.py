"""The *.safetensors files of a model directory, single or sharded, read memory-mapped.

Every file's header is read up front, so a truncated or corrupt file, or an index that
names a tensor its shard lacks, fails before any weight is copied, naming the file.
Tensors are read lazily, file by file (safe_open maps the file; nothing is read twice).
A tensor is a view of the mapping, and the pages it reads stay in this process's RSS
(RssFile, RssShmem for tmpfs) until the file is closed: release(name) drops them once the
tensor has been copied or packed, so a load never holds the whole checkpoint resident.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from hybridmoe.errors import CheckpointError
from hybridmoe.experts.fp8_codes import FP8_BLOCK
from hybridmoe.weights.fp8 import (
    FP8_DTYPES,
    SCALE_SUFFIX,
    dequant_block_fp8,
)
from hybridmoe.weights.mapped_pages import MappedPages

INDEX_NAME = "model.safetensors.index.json"

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
    "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


class SafetensorsCheckpoint:
    """Name -> tensor over all shards. Use as a context manager (it holds the open files)."""

    def __init__(self, model_dir: str | Path, fp8_block: tuple[int, int] = (128, 128),
                 fp8_scale_suffix: str = SCALE_SUFFIX, ignored_suffixes: tuple[str, ...] = ()):
        """fp8_block: an FP8 weight's scale block, 0 for a whole dimension (weights/fp8.py); fp8_scale_suffix: X's
        scale is X + this (DeepSeek-V3's weight_scale_inv, compressed-tensors' weight_scale); ignored_suffixes:
        tensors the model has no use for, left out of weight_names."""
        self.model_dir = Path(model_dir)
        self.fp8_block, self.fp8_scale_suffix, self.ignored_suffixes = fp8_block, fp8_scale_suffix, ignored_suffixes
        self._stack = ExitStack()
        self._handles: dict[str, object] = {}
        self._pages = MappedPages()
        self.file_of: dict[str, str] = {}
        try:
            for file in self._files():
                handle = self._open(file)
                for name in handle.keys():
                    if name in self.file_of:
                        raise CheckpointError(f"tensor {name} appears in both {self.file_of[name]} and {file}")
                    self.file_of[name] = file
            self._check_index()
        except BaseException:
            self._stack.close()
            raise

    def _files(self) -> list[str]:
        index = self.model_dir / INDEX_NAME
        if index.is_file():
            try:
                self._index = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index} is not a valid safetensors index ({e!r})") from None
            files = sorted(set(self._index.values()))
            for file in files:
                if not (self.model_dir / file).is_file():
                    raise CheckpointError(f"{INDEX_NAME} lists {file}, which is missing from {self.model_dir}")
            return files
        self._index = None
        files = sorted(p.name for p in self.model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.model_dir} has no *.safetensors weight files")
        return files

    def _open(self, file: str):
        try:
            handle = self._stack.enter_context(safe_open(self.model_dir / file, framework="pt", device="cpu"))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{self.model_dir / file} is truncated or corrupt ({e})") from None
        self._handles[file] = handle
        return handle

    def _check_index(self) -> None:
        if self._index is None:
            return
        for name, file in self._index.items():
            if self.file_of.get(name) != file:
                raise CheckpointError(f"{INDEX_NAME} puts tensor {name} in {file}, but that file does not hold it")

    def __enter__(self) -> "SafetensorsCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    @property
    def files(self) -> list[str]:
        return list(self._handles)

    def weight_names(self) -> list[str]:
        """Every tensor name a model receives: FP8 scales are folded into their weights, not listed."""
        return [n for n in self.file_of if not self._is_fp8_scale(n) and not n.endswith(self.ignored_suffixes)]

    def names_by_file(self) -> dict[str, list[str]]:
        by_file: dict[str, list[str]] = {f: [] for f in self._handles}
        for name in self.weight_names():
            by_file[self.file_of[name]].append(name)
        return {f: sorted(names) for f, names in by_file.items()}

    def _is_fp8_scale(self, name: str) -> bool:
        suffix = self.fp8_scale_suffix
        return name.endswith(suffix) and name[: -len(suffix)] in self.file_of

    def _slice(self, name: str):
        return self._handles[self.file_of[name]].get_slice(name)

    def dtype(self, name: str) -> torch.dtype | None:
        return _DTYPES.get(self._slice(name).get_dtype())

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def nbytes(self) -> int:
        return sum((self.model_dir / f).stat().st_size for f in self._handles)

    def get(self, name: str) -> torch.Tensor:
        """The tensor as the model should see it: FP8 block-quantized weights come back dequantized (float32)."""
        tensor = self._read(name)
        if tensor.dtype in FP8_DTYPES:
            scale = name + self.fp8_scale_suffix
            if scale not in self.file_of:
                raise CheckpointError(f"FP8 tensor {name} has no {scale} beside it in {self.model_dir}")
            try:
                tensor = dequant_block_fp8(tensor, self._read(scale), self.fp8_block)
            except ValueError as e:
                raise CheckpointError(f"{scale}: {e}") from None
        return tensor

    def fp8_codes(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An FP8 weight as stored: its codes (a view of the mapping, nothing read) and its scale_inv in float32,
        when the checkpoint's scale blocks are the native fp8 format's (FP8_BLOCK x FP8_BLOCK); None for any other
        tensor or block size (get() then dequantizes it)."""
        if self.fp8_block != (FP8_BLOCK, FP8_BLOCK) or self.dtype(name) not in FP8_DTYPES:
            return None
        codes, scale = self._read(name), name + self.fp8_scale_suffix
        if scale not in self.file_of:
            raise CheckpointError(f"FP8 tensor {name} has no {scale} beside it in {self.model_dir}")
        scale_inv = self._read(scale)
        expected = tuple(-(-n // FP8_BLOCK) for n in codes.shape)
        if codes.dim() != 2 or tuple(scale_inv.shape) != expected:
            raise CheckpointError(f"{scale}: scale shape {tuple(scale_inv.shape)} does not fit weight "
                                  f"{tuple(codes.shape)} in {FP8_BLOCK}x{FP8_BLOCK} blocks (expected {expected})")
        return codes, scale_inv.float()

    def release(self, name: str) -> None:
        """Drop tensor name's pages from this process's resident memory (not from the page cache: a later
        read faults them back in, from memory). Only whole pages inside the tensor are dropped, and only
        when they lie in this file's own mapping: a tensor that is a copy is left alone."""
        tensor = self._read(name)  # a view of the mapping: reads nothing
        self._pages.release(self.model_dir / self.file_of[name], tensor.data_ptr(), tensor.nbytes)

    def _read(self, name: str) -> torch.Tensor:
        file = self.file_of[name]
        try:
            return self._handles[file].get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"cannot read tensor {name} from {self.model_dir / file} ({e})") from None
