"""Routed experts in the native engine's packed layout, on disk and memory-mapped back.

A packed-experts directory (a `hybridmoe convert` output, or one entry of the expert cache)
holds one safetensors file per MoE layer under experts/, whose tensors are the engine's packed
buffers (opaque named byte/scale arrays, see CpuExperts.packed_state) and whose metadata is the
layer's shape and format; and the manifest hybridmoe_experts.json, written last, that lists
every layer with the sha256 of its file's header and a probe: the sha256 of expert 0's weights
as the engine unpacks them. Reading checks, per layer, the header checksum (so a replaced or
re-written file fails), the file size (so a truncated one fails), the shape and format against
what the model needs, and the probe (so a build of the engine whose packed layout changed fails
instead of computing garbage). The buffers are never copied: they are mapped copy-on-write.

Shapes: E experts, H hidden, I expert intermediate size.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from hybridmoe.errors import CheckpointError

MANIFEST = "hybridmoe_experts.json"
LAYOUT_VERSION = 1
"""Version of this directory layout (not of the engine's packed buffers: the probe covers those)."""

_NP_DTYPES = {"U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16, "F16": np.float16,
              "BF16": np.uint16, "F32": np.float32, "I32": np.int32, "U32": np.uint32, "F64": np.float64,
              "I64": np.int64, "U64": np.uint64}


@dataclass(frozen=True)
class PackedSpec:
    """What the model asks of a layer's packed experts."""

    shape: tuple[int, int, int]  # E, H, I (the engine's order)
    format: str
    group_size: int
    zero_points: bool = False

    def describe(self) -> str:
        group = f" g{self.group_size}" if self.format == "int4" else ""
        zp = " with zero points" if self.zero_points else ""
        return f"{self.format}{group}{zp}"


def probe(experts) -> str:
    """sha256 of expert 0's gate/up/down as the engine unpacks them (float32 bytes)."""
    h = hashlib.sha256()
    for w in experts.dequantized(0):
        h.update(w.contiguous().numpy().tobytes())
    return h.hexdigest()


def _layer_file(layer: int) -> str:
    return f"experts/layer-{layer:05d}.safetensors"


class PackedWriter:
    """Writes packed layers into a staging directory (callers may add files to `stage`); commit() publishes."""

    def __init__(self, out_dir: str | Path, spec_fields: dict, source: dict):
        self.out_dir = Path(out_dir)
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        self.stage = Path(tempfile.mkdtemp(prefix=".packing-", dir=self.out_dir.parent))
        umask = os.umask(0)
        os.umask(umask)
        self.stage.chmod(0o777 & ~umask)  # mkdtemp's 0700 would make the published directory private
        (self.stage / "experts").mkdir()
        self.manifest = {"layout_version": LAYOUT_VERSION, **spec_fields, "source": source, "layers": {}}

    def add(self, layer: int, experts) -> None:
        state = experts.packed_state()
        meta = {"shape": json.dumps(list(state["shape"])), "format": state["format"],
                "group_size": str(state["group_size"]), "zero_points": str(bool(state["zero_points"])),
                "numa_nodes": str(state["numa_nodes"])}
        file = _layer_file(layer)
        save_file({k: np.ascontiguousarray(v) for k, v in state["buffers"].items()}, self.stage / file,
                  metadata=meta)
        header, _ = _read_header(self.stage / file)
        self.manifest["layers"][str(layer)] = {
            "file": file, "shape": list(state["shape"]), "header_sha256": hashlib.sha256(header).hexdigest(),
            "probe_sha256": probe(experts)}

    def commit(self) -> Path:
        """Publish: manifest written last, then the staging directory renamed to out_dir.

        out_dir may exist only empty or as an earlier packed-experts directory (which is replaced).
        """
        (self.stage / MANIFEST).write_text(json.dumps(self.manifest, indent=1))
        if self.out_dir.exists():
            if any(self.out_dir.iterdir()) and not (self.out_dir / MANIFEST).is_file():
                self.abort()
                raise CheckpointError(f"{self.out_dir} exists and is not a packed-experts directory; pick another")
            shutil.rmtree(self.out_dir)
        os.replace(self.stage, self.out_dir)
        return self.out_dir

    def abort(self) -> None:
        shutil.rmtree(self.stage, ignore_errors=True)


def read_manifest(packed_dir: str | Path) -> dict | None:
    """The manifest of a packed-experts directory, or None if it has none."""
    path = Path(packed_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        _ = manifest["layers"], manifest["format"], manifest["group_size"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} is not a valid packed-experts manifest ({e!r}); convert again") from None
    if manifest.get("layout_version") != LAYOUT_VERSION:
        raise CheckpointError(f"{path} has layout version {manifest.get('layout_version')}, this hybridmoe reads "
                              f"{LAYOUT_VERSION}; convert again")
    return manifest


def _read_header(path: Path) -> tuple[bytes, int]:
    """(the safetensors JSON header bytes, offset of the data section)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path} is truncated (no safetensors header); convert again")
        (n,) = struct.unpack("<Q", head)
        header = f.read(n)
    if len(header) != n:
        raise CheckpointError(f"{path} is truncated (header cut short); convert again")
    return header, 8 + n


def load_layer(packed_dir: str | Path, manifest: dict, layer: int, spec: PackedSpec) -> dict:
    """A packed state for CpuExperts.from_packed, its buffers memory-mapped; every check of the module doc."""
    packed_dir = Path(packed_dir)
    entry = manifest["layers"].get(str(layer))
    if entry is None:
        raise CheckpointError(f"{packed_dir / MANIFEST} has no packed experts for MoE layer {layer}; convert again")
    path = packed_dir / entry["file"]
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; convert again")
    header, data_start = _read_header(path)
    if hashlib.sha256(header).hexdigest() != entry["header_sha256"]:
        raise CheckpointError(f"{path} does not match its checksum in {MANIFEST} (changed or corrupt); convert again")
    info = json.loads(header)
    meta = info.pop("__metadata__", {})
    got = PackedSpec(tuple(json.loads(meta["shape"])), meta["format"], int(meta["group_size"]),
                     meta["zero_points"] == "True")
    if got != spec:
        raise CheckpointError(f"{path} holds experts of shape {list(got.shape)} in {got.describe()}, but the model "
                              f"needs {list(spec.shape)} in {spec.describe()}; convert again or pick matching options")
    end = max((t["data_offsets"][1] for t in info.values()), default=0)
    if path.stat().st_size < data_start + end:
        raise CheckpointError(f"{path} is truncated ({path.stat().st_size} of {data_start + end} bytes); "
                              "convert again")
    buffers = {}
    for name, t in info.items():
        begin, stop = t["data_offsets"]
        dtype = np.dtype(_NP_DTYPES[t["dtype"]])
        count = (stop - begin) // dtype.itemsize
        # copy-on-write: the engine may take a writable array; pages are shared with the file until written
        buffers[name] = np.memmap(path, dtype=dtype, mode="c", offset=data_start + begin, shape=(count,))
    return {"shape": list(got.shape), "format": got.format, "group_size": got.group_size,
            "zero_points": got.zero_points, "numa_nodes": int(meta["numa_nodes"]), "buffers": buffers}


def check_probe(packed_dir: str | Path, manifest: dict, layer: int, experts) -> None:
    if probe(experts) != manifest["layers"][str(layer)]["probe_sha256"]:
        raise CheckpointError(
            f"the packed experts of layer {layer} in {packed_dir} do not unpack to the weights they were written "
            "with (corrupt, or written by a native engine with another packed layout); convert again")
