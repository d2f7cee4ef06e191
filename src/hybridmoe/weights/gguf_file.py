"""One GGUF model: a .gguf file or the parts of a split (`name-00001-of-00003.gguf`), parsed by `gguf`.

Every part's header is read up front (GGUFReader maps the file), so a wrong magic, a truncated
file, a tensor type this `gguf` does not know or a missing part fails before any weight is read,
with one line naming the file. The tensor table is checked before any tensor is viewed, each
failure naming the tensor: its type is known, its shape is whole blocks of that type, its offset is
a multiple of the file's alignment, its bytes (elements / block size x bytes per block) lie inside
the file, and the tensors follow each other as llama.cpp lays them out (each one at the next aligned
offset after the one before: no overlap, no gap), so a type, shape or offset altered in the table
fails instead of reading a neighbour's bytes. An array in the metadata longer than the bytes left fails
too. The first part holds the metadata; every part holds tensors.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from hybridmoe.errors import CheckpointError

SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
MAGIC = b"GGUF"
MAX_DIMS = 4
"""GGML_MAX_DIMS: a tensor has 1 to 4 dimensions."""

_ITEM_BYTES = {**{int(t): np.dtype(np_type).itemsize for t, np_type in GGUFReader.gguf_scalar_to_np.items()},
               int(GGUFValueType.STRING): 8, int(GGUFValueType.ARRAY): 12}
"""The fewest bytes one array item of each value type takes (a string: its length; an array: type + length)."""


def split_paths(path: str | Path) -> list[Path]:
    """All parts of the model that path belongs to, in order; [path] if it is not a split."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file {str(path)!r} does not exist")
    m = SPLIT_NAME.match(path.name)
    if m is None:
        return [path]
    count = int(m.group("count"))
    parts = [path.with_name(f"{m.group('stem')}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    for i, part in enumerate(parts, 1):
        if not part.is_file():
            raise CheckpointError(f"GGUF split part {i} of {count} ({part.name}) is missing from {path.parent}")
    return parts


class _CheckedReader(GGUFReader):
    """GGUFReader plus the checks it leaves out; both hooks run inside its constructor."""

    def __init__(self, path: Path):
        self.path = path
        super().__init__(path, "r")

    def _get_field_parts(self, orig_offs, raw_type):
        # a flipped length byte would otherwise have GGUFReader loop over up to 2^64 empty items past the end
        if raw_type == GGUFValueType.ARRAY:
            item_type, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            if len(item_type) and len(count):
                least = _ITEM_BYTES.get(int(item_type[0]), 1)
                if int(count[0]) * least > len(self.data) - orig_offs - 12:
                    raise ValueError(f"a metadata array of {int(count[0])} items runs past the end of the file")
        return super()._get_field_parts(orig_offs, raw_type)

    def _build_tensors(self, start_offs, fields):
        check_tensor_table(self.path, [_tensor_entry(self.path, f) for f in fields], start_offs,
                           int(self.alignment), len(self.data))
        super()._build_tensors(start_offs, fields)


def _tensor_entry(path: Path, field) -> tuple[str, GGMLQuantizationType, list[int], int]:
    """(name, type, dims innermost first, offset in the data section) of one tensor-table entry."""
    _, name_data, n_dims, dims, raw_type, offset = field.parts
    name = bytes(name_data).decode("utf-8", "replace")
    if len(n_dims) != 1 or not 1 <= int(n_dims[0]) <= MAX_DIMS or len(dims) != int(n_dims[0]) or \
            len(raw_type) != 1 or len(offset) != 1:
        raise CheckpointError(f"{path} is truncated or corrupt: GGUF tensor {name!r} has a malformed entry in the "
                              "tensor table")
    try:
        qtype = GGMLQuantizationType(int(raw_type[0]))
        GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise CheckpointError(f"{path} has a tensor of unknown type {int(raw_type[0])}: {name} (this gguf package "
                              "cannot read it; upgrade gguf, or re-quantize to a known type)") from None
    return name, qtype, [int(d) for d in dims], int(offset[0])


def check_tensor_table(path: Path, entries: list[tuple[str, GGMLQuantizationType, list[int], int]], data_start: int,
                       alignment: int, file_size: int) -> None:
    """Each tensor's type, shape, offset and size against each other and the file (the module doc's list)."""
    spans = []
    for name, qtype, dims, offset in entries:
        block, type_size = GGML_QUANT_SIZES[qtype]
        what = f"GGUF tensor {name} ({qtype.name} {list(reversed(dims))}"
        if min(dims) < 1 or dims[0] % block:
            raise CheckpointError(f"{path} is corrupt: {what}) is not whole {qtype.name} blocks of {block} values "
                                  "per row")
        nbytes = math.prod(dims) // block * type_size
        if offset % alignment:
            raise CheckpointError(f"{path} is corrupt: {what}) starts at data offset {offset}, not a multiple of the "
                                  f"file's alignment {alignment}")
        if data_start + offset + nbytes > file_size:
            raise CheckpointError(f"{path} is truncated or corrupt: {what}, {nbytes} bytes at data offset {offset}) "
                                  f"runs past the end of the file ({file_size} bytes)")
        spans.append((offset, offset + nbytes, name, what))
    end, before = 0, "the start of the data section"
    for begin, stop, name, what in sorted(spans):
        expected = -(-end // alignment) * alignment
        if begin != expected:
            how = "overlaps" if begin < end else f"leaves {begin - expected} bytes unused after"
            raise CheckpointError(f"{path} is corrupt: {what}, at data offset {begin}) {how} {before}: a type, "
                                  "shape or offset in the tensor table does not match the data")
        end, before = stop, f"tensor {name}"


def _open(path: Path) -> GGUFReader:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != MAGIC:
        raise CheckpointError(f"{path} is not a GGUF file (magic {magic!r}, expected {MAGIC!r})")
    try:
        return _CheckedReader(path)
    except CheckpointError:
        raise
    except (ValueError, IndexError, OSError, KeyError, TypeError, OverflowError, RecursionError) as e:
        raise CheckpointError(f"{path} is truncated or corrupt ({type(e).__name__}: {e})") from None


def _count(metadata: dict, key: str, path: Path) -> int | None:
    value = metadata.get(key)
    if value is not None and (type(value) is not int or value < 0):
        raise CheckpointError(f"{path}: GGUF metadata {key} must be a count, got {value!r:.40}")
    return value


class GGUFFiles:
    """metadata: key -> value of the first part; tensors: name -> (ReaderTensor, part path)."""

    def __init__(self, path: str | Path):
        self.paths = split_paths(path)
        readers = [_open(p) for p in self.paths]
        try:
            self.metadata = {k: f.contents() for k, f in readers[0].fields.items()}
        except (ValueError, IndexError, TypeError) as e:
            raise CheckpointError(f"{self.paths[0]} has corrupt metadata ({type(e).__name__}: {e})") from None
        count = _count(self.metadata, "split.count", self.paths[0])
        if count is not None and count != len(self.paths):
            raise CheckpointError(f"{self.paths[0]} says the model has {count} split parts, but its file name says "
                                  f"{len(self.paths)}")
        self.tensors = {}
        for p, r in zip(self.paths, readers):
            for t in r.tensors:
                if t.name in self.tensors:
                    raise CheckpointError(f"GGUF tensor {t.name} appears in both {self.tensors[t.name][1]} and {p}")
                self.tensors[t.name] = (t, p)
        expected = _count(self.metadata, "split.tensors.count", self.paths[0])
        if expected is not None and expected != len(self.tensors):
            raise CheckpointError(f"{self.paths[0]}: the split parts hold {len(self.tensors)} tensors, the metadata "
                                  f"says {expected}; a part is truncated or from another model")

    def shape(self, name: str) -> tuple[int, ...]:
        """In torch order (GGUF lists dimensions innermost first)."""
        return tuple(int(d) for d in reversed(self.tensors[name][0].shape))

    def nbytes(self) -> int:
        return sum(p.stat().st_size for p in self.paths)
