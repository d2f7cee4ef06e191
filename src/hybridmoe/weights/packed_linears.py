"""What the readers of int-packed checkpoints (GPTQ/AWQ, compressed-tensors) share: a packed linear X is stored
as several tensors X<part> and shown to the loader once, as X.weight, the float weight it stands for."""

from __future__ import annotations

from pathlib import Path

from hybridmoe.weights.safetensors import SafetensorsCheckpoint


class PackedLinears:
    """The safetensors files of model_dir with each packed linear's parts (PARTS, the first the packed codes, which
    every packed linear has) named as one X.weight. A subclass reads the parts: shape, get, int4_codes."""

    PARTS: tuple[str, ...] = ()

    def __init__(self, model_dir: str | Path):
        self._ckpt = SafetensorsCheckpoint(model_dir)
        codes = self.PARTS[0]
        self._packed = {n[: -len(codes)] for n in self._ckpt.file_of if n.endswith(codes)}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._ckpt.__exit__(*exc)

    def _base(self, name: str) -> str | None:
        """X where name is one of the packed linear X's parts; None for any other tensor."""
        for suffix in self.PARTS:
            if name.endswith(suffix) and name[: -len(suffix)] in self._packed:
                return name[: -len(suffix)]
        return None

    def names_by_file(self) -> dict[str, list[str]]:
        out = {}
        for file, names in self._ckpt.names_by_file().items():
            shown = [self._base(n) + ".weight" if n.endswith(self.PARTS[0]) and self._base(n) else n
                     for n in names if self._base(n) is None or n.endswith(self.PARTS[0])]
            out[file] = sorted(shown)
        return out

    def nbytes(self) -> int:
        return self._ckpt.nbytes()

    def _packed_base(self, name: str) -> str | None:
        """X where name is X.weight of a packed linear; None for a tensor stored as it is."""
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        return base if base in self._packed else None

    def release(self, name: str) -> None:
        """Drop the mapped pages that get(name) or int4_codes(name) read (every packed part of a linear)
        from this process's RSS, once the caller has copied or packed what it got."""
        base = self._packed_base(name)
        for part in [name] if base is None else [base + s for s in self.PARTS if base + s in self._ckpt.file_of]:
            self._ckpt.release(part)
