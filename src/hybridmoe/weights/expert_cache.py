"""Routed experts in the native engine's packed layout, on disk and memory-mapped back.

A packed-experts directory (a `hybridmoe convert` output, or one entry of the expert cache)
holds one safetensors file per MoE layer under experts/, whose tensors are the engine's packed
buffers (opaque named byte/scale arrays, see CpuExperts.packed_state) and whose metadata is the
layer's shape and format; and the manifest hybridmoe_experts.json, written last, that lists
every layer with the sha256 of its file's header, a CRC-32 of each expert's packed bytes, and a
probe: the sha256 of expert 0's weights as the engine unpacks them. Reading checks every value of
the manifest by type and range, then per layer the header checksum (so a replaced or re-written
file fails), the file size (so a truncated one fails), the shape and format against what the
model needs, each expert's CRC-32 (verify_layers: so a flipped byte in any expert fails, naming
it) and the probe (so a build of the engine whose packed layout changed fails instead of
computing garbage). The buffers are never copied: they are mapped copy-on-write.

Every packed buffer is expert-major ([E, ...]), so expert e's bytes are the e-th E-th of each
buffer; its CRC-32 runs over those parts of the layer file's tensors in the order of their data offsets.

Shapes: E experts, H hidden, I expert intermediate size.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from hybridmoe.errors import CheckpointError
from hybridmoe.weights.int4_codes import INT4_GROUPS

MANIFEST = "hybridmoe_experts.json"
LAYOUT_VERSION = 2
"""Version of this directory layout (not of the engine's packed buffers: the probe covers those). Version 1,
the same without expert_crc32, still loads: see has_expert_checksums."""

PACKED_FORMATS = ("bf16", "int8", "int4", "fp8")

_NP_DTYPES = {"U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16, "F16": np.float16,
              "BF16": np.uint16, "F32": np.float32, "I32": np.int32, "U32": np.uint32, "F64": np.float64,
              "I64": np.int64, "U64": np.uint64}
_SHA256 = re.compile(r"[0-9a-f]{64}")
_LAYER_KEY = re.compile(r"0|[1-9][0-9]*")


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


def expert_crc32(buffers: dict[str, np.ndarray], order: list[str], num_experts: int) -> list[int]:
    """Each expert's CRC-32 over its part of each buffer, buffers taken in `order`."""
    crcs = [0] * num_experts
    for name in order:
        raw = np.ascontiguousarray(buffers[name]).reshape(-1).view(np.uint8)
        part = _expert_part(name, raw.nbytes, num_experts)
        for e in range(num_experts):
            crcs[e] = zlib.crc32(raw[e * part:(e + 1) * part], crcs[e])
    return crcs


def _expert_part(name: str, nbytes: int, num_experts: int) -> int:
    if nbytes % num_experts:
        raise CheckpointError(f"packed buffer {name} of {nbytes} bytes does not split into {num_experts} experts")
    return nbytes // num_experts


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
        order = [name for name, _, _ in _parse_header(self.stage / file, header)[1]]
        self.manifest["layers"][str(layer)] = {
            "file": file, "shape": list(state["shape"]), "header_sha256": hashlib.sha256(header).hexdigest(),
            "expert_crc32": expert_crc32(state["buffers"], order, int(state["shape"][0])),
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
    """The manifest of a packed-experts directory, every value checked by type and range; None if it has none."""
    path = Path(packed_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{path} is not a valid packed-experts manifest ({e!r}); convert again") from None
    _check_manifest(manifest, path)
    return manifest


def has_expert_checksums(manifest: dict) -> bool:
    """Whether the manifest holds each expert's CRC-32 (layout version 2 on; version 1 checks expert 0 only)."""
    return manifest["layout_version"] >= 2


def _is_int(value, low: int, high: int | None = None) -> bool:
    return type(value) is int and value >= low and (high is None or value <= high)


def _check_manifest(m, path: Path) -> None:
    def bad(key: str, value, want: str):
        return CheckpointError(f"{path}: {key} must be {want}, got {json.dumps(value)[:60]}; convert again")

    if not isinstance(m, dict):
        raise bad("the manifest", m, "a JSON object")
    version = m.get("layout_version")
    if type(version) is not int or version not in (1, LAYOUT_VERSION):
        raise CheckpointError(f"{path} has layout version {json.dumps(version)[:20]}, this hybridmoe reads 1 and "
                              f"{LAYOUT_VERSION}; convert again")
    checks = {"format": (lambda v: v in PACKED_FORMATS, f"one of {', '.join(PACKED_FORMATS)}"),
              "group_size": (lambda v: type(v) is int and v in INT4_GROUPS, "32, 64 or 128"),
              "zero_points": (lambda v: type(v) is bool, "true or false"),
              "source": (lambda v: isinstance(v, dict) and isinstance(v.get("model_dir", ""), str),
                         'an object with a string "model_dir"'),
              "layers": (lambda v: isinstance(v, dict), "an object of layer -> file entry")}
    for key, (ok, want) in checks.items():
        if not ok(m.get(key)):
            raise bad(key, m.get(key), want)
    for layer, entry in m["layers"].items():
        _check_layer_entry(layer, entry, version, bad)


def _check_layer_entry(layer: str, entry, version: int, bad) -> None:
    where = f"layers.{layer}"
    if not _LAYER_KEY.fullmatch(layer):
        raise bad(f"the layer key {layer!r}", layer, "a layer number")
    if not isinstance(entry, dict):
        raise bad(where, entry, "an object")
    checks = {"file": (lambda v: v == _layer_file(int(layer)), json.dumps(_layer_file(int(layer)))),
              "shape": (lambda v: isinstance(v, list) and len(v) == 3 and all(_is_int(d, 1) for d in v),
                        "3 positive integers [E, H, I]"),
              "header_sha256": (lambda v: isinstance(v, str) and _SHA256.fullmatch(v), "a sha256 in hex"),
              "probe_sha256": (lambda v: isinstance(v, str) and _SHA256.fullmatch(v), "a sha256 in hex")}
    for key, (ok, want) in checks.items():
        if not ok(entry.get(key)):
            raise bad(f"{where}.{key}", entry.get(key), want)
    crcs, E = entry.get("expert_crc32"), entry["shape"][0]
    if version >= 2 and not (isinstance(crcs, list) and len(crcs) == E and all(_is_int(c, 0, 0xFFFFFFFF)
                                                                               for c in crcs)):
        raise bad(f"{where}.expert_crc32", crcs, f"a CRC-32 per expert ({E} integers below 2^32)")


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


def _parse_header(path: Path, header: bytes) -> tuple[dict, list[tuple[str, str, tuple[int, int]]]]:
    """(metadata, [(name, dtype, (begin, end) in the data section)] in data order) of a layer file's header."""
    try:
        info = json.loads(header)
        meta = info.pop("__metadata__", {})
        tensors = [(name, t["dtype"], (int(t["data_offsets"][0]), int(t["data_offsets"][1])))
                   for name, t in info.items()]
        if not all(dtype in _NP_DTYPES and 0 <= begin <= end for _, dtype, (begin, end) in tensors):
            raise ValueError("a tensor of unknown dtype or with reversed offsets")
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise CheckpointError(f"{path} has a malformed safetensors header ({e!r}); convert again") from None
    return meta, sorted(tensors, key=lambda t: t[2])


def _layer_header(packed_dir: Path, manifest: dict, layer: int) -> tuple[Path, int, dict, list]:
    """(path, data start, metadata, tensor ranges) of a layer's file, checked against the manifest and its size."""
    entry = manifest["layers"].get(str(layer))
    if entry is None:
        raise CheckpointError(f"{packed_dir / MANIFEST} has no packed experts for MoE layer {layer}; convert again")
    path = packed_dir / entry["file"]
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; convert again")
    header, data_start = _read_header(path)
    if hashlib.sha256(header).hexdigest() != entry["header_sha256"]:
        raise CheckpointError(f"{path} does not match its checksum in {MANIFEST} (changed or corrupt); convert again")
    meta, tensors = _parse_header(path, header)
    end = max((stop for _, _, (_, stop) in tensors), default=0)
    if path.stat().st_size < data_start + end:
        raise CheckpointError(f"{path} is truncated ({path.stat().st_size} of {data_start + end} bytes); "
                              "convert again")
    return path, data_start, meta, tensors


def load_layer(packed_dir: str | Path, manifest: dict, layer: int, spec: PackedSpec) -> dict:
    """A packed state for CpuExperts.from_packed, its buffers memory-mapped; every check of the module doc but
    the experts' CRC-32 (verify_layers) and the probe (check_probe)."""
    path, data_start, meta, tensors = _layer_header(Path(packed_dir), manifest, layer)
    try:
        got = PackedSpec(tuple(json.loads(meta["shape"])), meta["format"], int(meta["group_size"]),
                         meta["zero_points"] == "True")
        numa_nodes = int(meta["numa_nodes"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} has malformed metadata ({e!r}); convert again") from None
    if got != spec:
        raise CheckpointError(f"{path} holds experts of shape {list(got.shape)} in {got.describe()}, but the model "
                              f"needs {list(spec.shape)} in {spec.describe()}; convert again or pick matching options")
    buffers = {}
    for name, dtype, (begin, stop) in tensors:
        dtype = np.dtype(_NP_DTYPES[dtype])
        # copy-on-write: the engine may take a writable array; pages are shared with the file until written
        buffers[name] = np.memmap(path, dtype=dtype, mode="c", offset=data_start + begin,
                                  shape=((stop - begin) // dtype.itemsize,))
    return {"shape": list(got.shape), "format": got.format, "group_size": got.group_size,
            "zero_points": got.zero_points, "numa_nodes": numa_nodes, "buffers": buffers}


def verify_layers(packed_dir: str | Path, manifest: dict, layers: list[int], threads: int | None = None) -> None:
    """Every expert's packed bytes of these layers against its CRC-32 in the manifest, layers read in parallel
    (zlib and file reads release the GIL); the first layer in order with a mismatch raises, naming the expert.
    The files are read, not mapped: the pages stay in the page cache, out of this process's RSS."""
    packed_dir = Path(packed_dir)
    threads = max(1, min(threads or os.cpu_count() or 1, len(layers) or 1))
    with ThreadPoolExecutor(threads) as pool:
        for _ in pool.map(lambda layer: _verify_layer(packed_dir, manifest, layer), layers):
            pass


def _verify_layer(packed_dir: Path, manifest: dict, layer: int) -> None:
    path, data_start, _, tensors = _layer_header(packed_dir, manifest, layer)
    want = manifest["layers"][str(layer)]["expert_crc32"]
    E = len(want)
    crcs = [0] * E
    parts = [_expert_part(f"{path}: {name}", stop - begin, E) for name, _, (begin, stop) in tensors]
    buf = memoryview(bytearray(max(parts, default=0)))
    with open(path, "rb", buffering=0) as f:
        for part, (_, _, (begin, _)) in zip(parts, tensors):
            f.seek(data_start + begin)
            for e in range(E):
                if f.readinto(buf[:part]) != part:
                    raise CheckpointError(f"{path} is truncated; convert again")
                crcs[e] = zlib.crc32(buf[:part], crcs[e])
    for e, (got, expected) in enumerate(zip(crcs, want)):
        if got != expected:
            raise CheckpointError(f"{path}: expert {e} of layer {layer} does not match its checksum in {MANIFEST} "
                                  "(changed or corrupt); convert again")


def check_probe(packed_dir: str | Path, manifest: dict, layer: int, experts) -> None:
    if probe(experts) != manifest["layers"][str(layer)]["probe_sha256"]:
        raise CheckpointError(
            f"the packed experts of layer {layer} in {packed_dir} do not unpack to the weights they were written "
            "with (corrupt, or written by a native engine with another packed layout); convert again")
