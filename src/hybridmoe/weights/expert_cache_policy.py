"""Where one load's routed experts come from: the checkpoint, a converted directory, or the expert cache.

- A converted directory (`hybridmoe convert`) carries packed experts: they are used as they are,
  and the engine options must match them (a mismatch is an error naming the options to pass).
  Every expert's bytes are checked against their CRC-32 (verify_experts "full"; "header" checks the
  headers and expert 0 only); a directory converted before the checksums loads with a warning.
- Otherwise, with the native engine in int8/int4 (or fp8 from another checkpoint than a 128x128 block-FP8
  one), experts without biases and a cache directory: the first start packs the
  checkpoint's experts and writes them to <cache_dir>/experts/<key>/; the next start with the same
  checkpoint files and options maps them back instead of reading and quantizing. The key covers
  the checkpoint's config.json, its weight files (path, size, mtime) and the packing options.
  A cache entry that fails any check, or was written before the checksums, is rebuilt, not an error;
  failing to write one is a warning.
  An entry is written only when the disk keeps CACHE_MIN_FREE_FRACTION free after it (else a warning
  says so), and writing one first drops the entries nothing can reach any more: those of the same
  checkpoint whose files have changed since, and those whose checkpoint directory is gone.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path

from tqdm.auto import tqdm

from hybridmoe.config import EngineConfig, format_bytes
from hybridmoe.errors import CheckpointError, HybridMoEError
from hybridmoe.experts.fp8_codes import FP8_BLOCK
from hybridmoe.weights.expert_cache import (
    MANIFEST,
    PackedSpec,
    PackedWriter,
    check_probe,
    has_expert_checksums,
    load_layer,
    read_manifest,
    verify_layers,
)
from hybridmoe.weights.native_format import block_fp8_block

CACHED_FORMATS = ("int8", "int4", "fp8")
"""bf16 packing is a copy, as fast as reading a cache would be: only quantized formats are cached, and fp8 only where
it quantizes (from a block-FP8 checkpoint in its own 128x128 blocks, packing copies the codes: _packs_by_copy). mxfp4
is not cached: MXFP4 checkpoints (gpt-oss) pack by copying their codes and have expert biases, and float experts
asked for mxfp4 quantize at every load."""

CACHE_MIN_FREE_FRACTION = 0.1
"""Of the cache disk's size, left free after writing an entry: a cache entry (hundreds of GB for the largest
models) never fills the disk."""

_PROGRESS_MIN_BYTES = 1 << 30


def cache_root(engine_config: EngineConfig) -> Path | None:
    """engine_config.cache_dir resolved: None -> $XDG_CACHE_HOME/hybridmoe; "" -> no cache."""
    if engine_config.cache_dir == "":
        return None
    if engine_config.cache_dir is not None:
        return Path(engine_config.cache_dir).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hybridmoe"


def weight_files(model_dir: Path) -> list[Path]:
    """The files a model directory's weights are read from (a GGUF model's live outside it)."""
    files = sorted(model_dir.glob("*.safetensors"))
    source = model_dir / "gguf_source.json"
    if source.is_file():
        files += [Path(f) for f in json.loads(source.read_text())["files"]]
    return files


def cache_key(model_dir: Path, spec_fields: dict) -> str:
    h = hashlib.sha256()
    h.update((model_dir / "config.json").read_bytes())
    for f in weight_files(model_dir):
        st = f.stat()
        h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    h.update(json.dumps(spec_fields, sort_keys=True).encode())
    return h.hexdigest()[:32]


class PackedExperts:
    """Built by plan_packed_experts before the weights are read; finish() runs after."""

    def __init__(self, reads_checkpoint: bool, adopted: dict | None = None, writer_args: tuple | None = None):
        self.reads_checkpoint = reads_checkpoint
        """False: the packed experts are already here; the checkpoint's expert tensors are not read."""
        self._adopted = adopted or {}
        self._writer_args = writer_args
        self.cache_hit = bool(adopted) and writer_args is None

    def finish(self, backend) -> None:
        for layer, experts in self._adopted.items():
            backend.adopt(layer, experts)
        if self._writer_args is not None:
            self._write_cache(backend)

    def _write_cache(self, backend) -> None:
        out_dir, spec_fields, source = self._writer_args
        drop_unreachable_entries(out_dir.parent, Path(source["model_dir"]))
        nbytes = sum(backend.layer_experts(layer).packed_bytes for layer in backend.layers())
        total, free = _disk_space(out_dir.parent)
        if free - nbytes < CACHE_MIN_FREE_FRACTION * total:
            warnings.warn(f"not caching the packed experts ({format_bytes(nbytes)}) in {out_dir.parent}: "
                          f"{format_bytes(free)} free of {format_bytes(total)}, and the cache leaves "
                          f"{CACHE_MIN_FREE_FRACTION:.0%} free; the next start packs again (set cache_dir, "
                          "--cache-dir, to a disk with room, or to '' for no cache)", stacklevel=2)
            return
        writer = None
        try:
            writer = PackedWriter(out_dir, spec_fields, source)
            for layer in tqdm(backend.layers(), desc=f"caching {format_bytes(nbytes)} of packed experts in "
                              f"{out_dir.parent}", unit="layer", leave=False, disable=nbytes < _PROGRESS_MIN_BYTES):
                writer.add(layer, backend.layer_experts(layer))
            writer.commit()
        except (OSError, CheckpointError) as e:
            if writer is not None:
                writer.abort()
            warnings.warn(f"could not write the packed-expert cache to {out_dir} ({e}); the next start packs again",
                          stacklevel=2)


def _disk_space(path: Path) -> tuple[int, int]:
    """(total, free) bytes of the disk path is on (or would be, once made)."""
    while not path.exists():
        path = path.parent
    usage = shutil.disk_usage(path)
    return usage.total, usage.free


def drop_unreachable_entries(entries: Path, model_dir: Path) -> None:
    """Remove the cache entries under `entries` that no start can read again: model_dir's entries whose
    key its files no longer give (changed or re-downloaded since), and entries whose source directory is
    gone. Entries this hybridmoe cannot read (another version's) are left alone."""
    if not entries.is_dir():
        return
    model_dir = model_dir.resolve()
    for entry in entries.iterdir():
        if entry.name.startswith("."):
            continue  # another start's entry being written (PackedWriter's staging directory)
        try:
            manifest = read_manifest(entry)
        except CheckpointError:
            continue
        if manifest is None:
            continue
        spec = {k: manifest.get(k) for k in ("format", "group_size", "zero_points")}
        source = Path((manifest.get("source") or {}).get("model_dir") or "")
        if not source.is_absolute() or None in spec.values():
            continue  # not an entry this cache wrote
        if manifest.get("mtp"):
            spec["mtp"] = True
        if not (source / "config.json").is_file() or (source == model_dir and entry.name != cache_key(source, spec)):
            shutil.rmtree(entry, ignore_errors=True)


def _packs_by_copy(engine_config: EngineConfig, config) -> bool:
    """Whether the experts go into fp8 straight from a block-FP8 checkpoint's codes (nothing to save in a cache)."""
    block = block_fp8_block(config.get("quantization_config") or {})
    return engine_config.expert_format == "fp8" and block == (FP8_BLOCK, FP8_BLOCK)


def _spec_fields(engine_config: EngineConfig) -> dict:
    """What an entry's key covers besides the checkpoint's files: the packing options, and with --mtp the MTP
    module's MoE layers, which the model then has beside its own (models/mtp.py): so a start with and one without
    it each find their own entry instead of repacking over the other's."""
    fields = {"format": engine_config.expert_format, "group_size": engine_config.expert_group_size,
              "zero_points": bool(engine_config.expert_zero_points) and engine_config.expert_format == "int4"}
    if engine_config.mtp:
        fields["mtp"] = True
    return fields


def _adopt_all(packed_dir: Path, manifest: dict, model, spec_fields: dict, backend,
               engine_config: EngineConfig) -> dict:
    """Every MoE layer's packed experts, mapped and checked (CheckpointError on any mismatch); each expert's
    CRC-32 too when engine_config.verify_experts is "full" and the manifest has them."""
    E, inter = model.expert_dims()
    spec = PackedSpec((E, model.config.hidden_size, inter), spec_fields["format"], spec_fields["group_size"],
                      spec_fields["zero_points"])
    extra = sorted(set(manifest["layers"]) - {str(layer) for layer in model.moe_layers}, key=int)
    if extra:
        raise CheckpointError(f"{packed_dir / MANIFEST} lists packed experts for layer {extra[0]}, which is not a "
                              "MoE layer of this config.json; convert again")
    adopted = {}
    for layer in model.moe_layers:
        experts = backend.from_packed(load_layer(packed_dir, manifest, layer, spec))
        check_probe(packed_dir, manifest, layer, experts)
        adopted[layer] = experts
    if engine_config.verify_experts == "full" and has_expert_checksums(manifest):
        verify_layers(packed_dir, manifest, list(model.moe_layers), engine_config.cpu_threads)
    return adopted


def plan_packed_experts(model_dir: Path, engine_config: EngineConfig, model, backend) -> PackedExperts:
    manifest = read_manifest(model_dir)
    if manifest is not None:
        if not has_expert_checksums(manifest):
            warnings.warn(f"{model_dir} was converted without per-expert checksums (layout version 1): only its "
                          "headers and expert 0 of each layer are checked; convert again to check every expert",
                          stacklevel=2)
        return PackedExperts(False, _adopt_all(model_dir, manifest, model, _converted_spec(manifest, engine_config),
                                               backend, engine_config))
    root = cache_root(engine_config)
    # An entry holds packed weights only: experts with biases (gpt-oss) pack at every load, where the biases are read.
    if (engine_config.expert_backend != "native" or engine_config.expert_format not in CACHED_FORMATS or root is None
            or _packs_by_copy(engine_config, model.config) or model.config.get("expert_bias")):
        return PackedExperts(True)
    spec_fields = _spec_fields(engine_config)
    entry = root / "experts" / cache_key(model_dir, spec_fields)
    try:
        cached = read_manifest(entry)
        if cached is not None and not has_expert_checksums(cached):
            raise CheckpointError("written without per-expert checksums")
        if cached is not None:
            return PackedExperts(False, _adopt_all(entry, cached, model, spec_fields, backend, engine_config))
    except (CheckpointError, HybridMoEError, OSError, KeyError, ValueError) as e:
        warnings.warn(f"ignoring the packed-expert cache entry {entry} ({e}); packing again", stacklevel=2)
    return PackedExperts(True, writer_args=(entry, spec_fields, {"model_dir": str(model_dir.resolve())}))


def _converted_spec(manifest: dict, engine_config: EngineConfig) -> dict:
    want = _spec_fields(engine_config)
    have = {k: manifest.get(k) for k in want}
    if engine_config.expert_backend != "native" or have["format"] != want["format"] or (
            have["format"] == "int4" and have["group_size"] != want["group_size"]):
        group = f" --expert-group-size {have['group_size']}" if have["format"] == "int4" else ""
        raise HybridMoEError(
            f"this directory holds experts converted to {have['format']}"
            f"{' g' + str(have['group_size']) if have['format'] == 'int4' else ''} for the native engine; "
            f"load it with --expert-backend native --expert-format {have['format']}{group}")
    return have
