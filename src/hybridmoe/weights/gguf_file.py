"""One GGUF model: a .gguf file or the parts of a split (`name-00001-of-00003.gguf`), parsed by `gguf`.

Every part's header is read up front (GGUFReader maps the file), so a wrong magic, a truncated
file, a tensor type this `gguf` does not know or a missing part fails before any weight is read,
with one line naming the file. The first part holds the metadata; every part holds tensors.
"""

from __future__ import annotations

import re
from pathlib import Path

from gguf import GGUFReader

from hybridmoe.errors import CheckpointError

SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
MAGIC = b"GGUF"


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


def _open(path: Path) -> GGUFReader:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != MAGIC:
        raise CheckpointError(f"{path} is not a GGUF file (magic {magic!r}, expected {MAGIC!r})")
    try:
        return GGUFReader(path, "r")
    except ValueError as e:
        if "GGMLQuantizationType" in str(e):
            raise CheckpointError(f"{path} has a tensor of unknown type ({e}); this gguf package "
                                  "cannot read it (upgrade gguf, or re-quantize to a known type)") from None
        raise CheckpointError(f"{path} is truncated or corrupt ({e})") from None
    except (IndexError, OSError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is truncated or corrupt ({type(e).__name__}: {e})") from None


class GGUFFiles:
    """metadata: key -> value of the first part; tensors: name -> (ReaderTensor, part path)."""

    def __init__(self, path: str | Path):
        self.paths = split_paths(path)
        readers = [_open(p) for p in self.paths]
        self.metadata = {k: f.contents() for k, f in readers[0].fields.items()}
        count = self.metadata.get("split.count")
        if count is not None and int(count) != len(self.paths):
            raise CheckpointError(f"{self.paths[0]} says the model has {count} split parts, but its file name says "
                                  f"{len(self.paths)}")
        self.tensors = {}
        for p, r in zip(self.paths, readers):
            for t in r.tensors:
                if t.name in self.tensors:
                    raise CheckpointError(f"GGUF tensor {t.name} appears in both {self.tensors[t.name][1]} and {p}")
                self.tensors[t.name] = (t, p)
        expected = self.metadata.get("split.tensors.count")
        if expected is not None and int(expected) != len(self.tensors):
            raise CheckpointError(f"{self.paths[0]}: the split parts hold {len(self.tensors)} tensors, the metadata "
                                  f"says {expected}; a part is truncated or from another model")

    def shape(self, name: str) -> tuple[int, ...]:
        """In torch order (GGUF lists dimensions innermost first)."""
        return tuple(int(d) for d in reversed(self.tensors[name][0].shape))

    def nbytes(self) -> int:
        return sum(p.stat().st_size for p in self.paths)
