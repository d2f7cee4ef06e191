"""`hybridmoe convert`: a checkpoint -> a directory whose routed experts are already packed for the native engine.

The output holds config.json (quantization_config dropped: every weight in it is plain), the
tokenizer and other side files as they are, the non-expert weights as safetensors (as the source
has them; GGUF, GPTQ/AWQ and FP8 ones dequantized to the checkpoint dtype), and experts/ with the
packed layers plus their manifest (expert_cache.py). Loading it maps the packed experts instead of
quantizing: see expert_cache_policy.py.

One pass over the source: the loader's own load_weights fills a model on the meta device (no
memory; it checks every name and shape), with a reader that copies each non-expert tensor out as
it goes and an ExpertBackend that packs each MoE layer as soon as it is complete and writes it.
GPTQ/AWQ 4-bit experts converted to int4 keep their zero points, and in the checkpoint's own group size
their codes are packed as they are (as a load does: weights/int4_codes.py), never through float.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from hybridmoe.config import EngineConfig
from hybridmoe.errors import HybridMoEError
from hybridmoe.experts.cpu_experts import CpuExperts
from hybridmoe.experts.factory import NativeLayers, expert_extras
from hybridmoe.models.registry import load_config
from hybridmoe.weights.expert_cache import MANIFEST, PackedWriter
from hybridmoe.weights.gguf_model_dir import resolve_model_path
from hybridmoe.weights.loader import load_weights, resolve_dtype
from hybridmoe.weights.native_format import check_int4_group, resolve_expert_format
from hybridmoe.weights.quantized import open_checkpoint

SHARD_BYTES = 4 << 30
_NOT_COPIED = ("gguf_source.json", MANIFEST, "model.safetensors.index.json")


@dataclass(frozen=True)
class ConvertSummary:
    out_dir: Path
    format: str
    group_size: int
    zero_points: bool
    moe_layers: int
    expert_bytes: int
    other_bytes: int
    seconds: float


class _ShardWriter:
    """Non-expert tensors into model-NNNNN.safetensors shards of at most SHARD_BYTES, plus the index."""

    def __init__(self, out_dir: Path, dtype: torch.dtype):
        self.out_dir, self.dtype = out_dir, dtype
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.weight_map: dict[str, str] = {}
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if tensor.dtype == torch.float32 and self.dtype != torch.float32:
            tensor = tensor.to(self.dtype)  # dequantized (GGUF, GPTQ/AWQ, FP8): to the checkpoint dtype
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += tensor.numel() * tensor.element_size()
        if self.pending_bytes >= SHARD_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        file = f"model-{len(set(self.weight_map.values())) + 1:05d}.safetensors"
        save_file(self.pending, self.out_dir / file, metadata={"format": "pt"})
        self.weight_map.update(dict.fromkeys(self.pending, file))
        self.total += self.pending_bytes
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        self.flush()
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(self.weight_map.items()))}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


class _CopyingReader:
    """The source checkpoint, copying each non-expert tensor the loader reads into the shard writer."""

    def __init__(self, ckpt, model, shards: _ShardWriter):
        self.ckpt, self.model, self.shards = ckpt, model, shards

    def names_by_file(self):
        return self.ckpt.names_by_file()

    def nbytes(self):
        return self.ckpt.nbytes()

    def shape(self, name):
        return self.ckpt.shape(name)

    @property
    def int4_group(self):
        return getattr(self.ckpt, "int4_group", None)

    @property
    def int4_symmetric(self):
        return getattr(self.ckpt, "int4_symmetric", False)

    def int4_codes(self, name):
        return self.ckpt.int4_codes(name)

    def fp8_codes(self, name):
        fp8_codes = getattr(self.ckpt, "fp8_codes", None)
        return fp8_codes(name) if fp8_codes is not None else None

    def get(self, name):
        tensor = self.ckpt.get(name)
        if self.model.expert_key(name) is None:
            self.shards.add(name, tensor)
        return tensor

    def release(self, name):
        # Experts only: the shard writer reads the others' pages again when it flushes.
        if self.model.expert_key(name) is not None and hasattr(self.ckpt, "release"):
            self.ckpt.release(name)


class _PackAndWrite(NativeLayers):
    """The native engine's layers, each written as soon as it is packed (adopt); nothing stays in memory."""

    def __init__(self, writer: PackedWriter, options: dict, bar):
        super().__init__(CpuExperts, **options)
        self.writer, self.bar = writer, bar
        self.done: list[int] = []
        self.bytes = 0

    def adopt(self, layer, experts):
        self.writer.add(layer, experts)
        self.bytes += experts.packed_bytes
        self.done.append(layer)
        self.bar.update()

    def layers(self):
        return sorted(self.done)

    def submit(self, layer, hidden, topk_ids, topk_weights):
        raise HybridMoEError("a model being converted does not run")

    def wait(self, layer):
        raise HybridMoEError("a model being converted does not run")


def _check_out_dir(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise HybridMoEError(f"--out {out} is a file, not a directory; pick a new directory")
    if out.is_dir() and any(out.iterdir()):
        if not (out / MANIFEST).is_file():
            raise HybridMoEError(f"--out {out} exists and is not empty; pick a new directory")
        if not force:
            raise HybridMoEError(f"--out {out} already holds a converted model; pass --force to replace it")


def convert_checkpoint(src: str | Path, out: str | Path, format: str = "auto", group_size: int | None = None,
                       force: bool = False, threads: int | None = None, progress: bool = True) -> ConvertSummary:
    """format "auto" and group_size None: what a load of src would pick (weights/native_format.py's
    resolve_expert_format: group_size None with int4 is a 4-bit source's own group size, else the engine's
    default; a group_size given is kept)."""
    start = time.perf_counter()
    options = EngineConfig(expert_backend="native", expert_format=format, expert_group_size=group_size,
                           cpu_threads=threads)
    out = Path(out)
    _check_out_dir(out, force)
    model_dir = resolve_model_path(src, options)
    if (Path(model_dir) / MANIFEST).is_file():
        raise HybridMoEError(f"{src} is already converted; convert its original checkpoint instead")
    cls, config = load_config(model_dir)
    if config.hidden_act not in ("silu", "swish"):
        raise HybridMoEError(f"the native engine runs SiLU experts only; this model uses {config.hidden_act!r}")
    extras = expert_extras(config)
    if extras is not None:
        raise HybridMoEError(f"a converted directory holds no routed experts with {extras}, which this model's need; "
                             "it runs unconverted (expert_backend native packs its experts at load)")
    dtype = resolve_dtype("auto", config)
    # int4 from GPTQ/AWQ 4-bit keeps its zero points, so that codes in the checkpoint's group size pack as they are
    resolved = resolve_expert_format(options, config, model_dir)
    format, group_size, zero_points = resolved.expert_format, resolved.expert_group_size, resolved.expert_zero_points
    spec = {"format": format, "group_size": group_size, "zero_points": zero_points}
    writer = PackedWriter(out, spec, {"model_dir": str(Path(src).resolve())})
    try:
        with torch.device("meta"):
            probe_model = cls(config, None)
        if format == "int4":
            check_int4_group(group_size, config.hidden_size, probe_model.expert_dims()[1],
                             "pass group_size {g} (--group-size {g})", "pass format int8 (--format int8)")
        with tqdm(total=len(probe_model.moe_layers), desc="packing experts", unit="layer",
                  disable=not progress) as bar:
            backend = _PackAndWrite(writer, {"format": format, "group_size": group_size,
                                             "zero_points": zero_points, "threads": threads}, bar)
            with torch.device("meta"):
                model = cls(config, backend)
            shards = _ShardWriter(writer.stage, dtype)
            with open_checkpoint(model_dir, config) as ckpt:
                load_weights(model, _CopyingReader(ckpt, model, shards), torch.device("cpu"), dtype)
            shards.close()
        _copy_side_files(Path(model_dir), writer.stage)
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    return ConvertSummary(out, format, group_size, zero_points, len(backend.done), backend.bytes, shards.total,
                          time.perf_counter() - start)


def _copy_side_files(src: Path, dst: Path) -> None:
    for f in sorted(src.iterdir()):
        if f.is_file() and f.suffix != ".safetensors" and f.name not in _NOT_COPIED:
            shutil.copyfile(f, dst / f.name)
    config = json.loads((dst / "config.json").read_text())
    for values in (config, config.get("text_config") or {}):  # a multimodal config.json (Kimi-K2.5's) nests it
        values.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config, indent=1))
