"""A streaming safetensors writer: sharded files plus model.safetensors.index.json, never a whole
tensor (let alone a shard) in memory.

The format: 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}
padded with spaces to a multiple of 8, then the tensors' bytes back to back. All shapes are known
up front, so each header is written first and the bytes follow, generated chunk by chunk.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from pathlib import Path

import torch
from tqdm import tqdm

from hybridmoe.checkpoint.tensors import TensorSpec

_ST_DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16", torch.float8_e4m3fn: "F8_E4M3"}
CHUNK_ELEMENTS = 1 << 22  # 4M values per generate+write step: 16 MiB of float32 scratch
DEFAULT_SHARD_BYTES = 4 << 30


def plan_shards(specs: list[TensorSpec], max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[list[TensorSpec]]:
    """Split tensors, in order, into shards of at most max_shard_bytes (a bigger single tensor gets
    its own shard). Always at least two shards when there are two tensors, so that every checkpoint,
    tiny ones included, exercises sharded loading."""
    total = sum(s.nbytes for s in specs)
    limit = min(max_shard_bytes, math.ceil(total / 2))
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def tensor_seed(seed: int, name: str) -> int:
    """A piece's own seed: a tensor's values depend on (seed, name) only, not on the order, sharding
    or number of layers, so `--layers 2` writes the same first two layers as the full model."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _header(shard: list[TensorSpec]) -> bytes:
    entries: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in shard:
        entries[spec.name] = {"dtype": _ST_DTYPES[spec.dtype], "shape": list(spec.shape),
                              "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


class _RandomWriter:
    """Writes tensors' values: normal(mean, std), cast to the tensor's dtype, as raw bytes.

    Each CHUNK_ELEMENTS piece of a tensor has its own generator, seeded from (seed, name, piece),
    so pieces are drawn in parallel by WORKERS threads (one per core, 2 to 16; torch releases the GIL) into a ring of
    reused buffers while this thread writes finished pieces in file order."""

    WORKERS = max(2, min(16, len(os.sched_getaffinity(0))))  # drawing is the bottleneck, not the writes
    RING = 2 * WORKERS

    def __init__(self, seed: int):
        self.seed = seed
        self.scratch = [torch.empty(CHUNK_ELEMENTS, dtype=torch.float32) for _ in range(self.RING)]
        self.cast = [{dt: torch.empty(CHUNK_ELEMENTS, dtype=dt) for dt in _ST_DTYPES if dt != torch.float32}
                     for _ in range(self.RING)]
        self.pool = ThreadPoolExecutor(max_workers=self.WORKERS, thread_name_prefix="make-model")

    def _draw(self, spec: TensorSpec, piece: int, slot: int) -> torch.Tensor:
        n = min(CHUNK_ELEMENTS, spec.numel - piece * CHUNK_ELEMENTS)
        gen = torch.Generator().manual_seed(tensor_seed(self.seed, f"{spec.name}#{piece}"))
        values = self.scratch[slot][:n].normal_(spec.mean, spec.std, generator=gen)
        if spec.dtype != torch.float32:
            values = self.cast[slot][spec.dtype][:n].copy_(values)
        return values

    def write(self, f, shard: list[TensorSpec], bar: tqdm) -> None:
        pieces = ((spec, p) for spec in shard for p in range(math.ceil(spec.numel / CHUNK_ELEMENTS)))
        in_flight: deque[Future] = deque()
        for k, (spec, p) in enumerate(pieces):
            if len(in_flight) == self.RING:  # the oldest piece holds the slot we are about to reuse
                self._write_one(f, in_flight.popleft(), bar)
            in_flight.append(self.pool.submit(self._draw, spec, p, k % self.RING))
        while in_flight:
            self._write_one(f, in_flight.popleft(), bar)

    @staticmethod
    def _write_one(f, fut: Future, bar: tqdm) -> None:
        values = fut.result()
        f.write(values.view(torch.uint8).numpy().data)
        bar.update(values.numel() * values.element_size())

    def close(self) -> None:
        self.pool.shutdown()


def write_random_safetensors(out_dir: Path, specs: list[TensorSpec], seed: int, *,
                             max_shard_bytes: int = DEFAULT_SHARD_BYTES, progress: bool = True) -> list[Path]:
    """Write `specs` with random values as model-0000i-of-0000n.safetensors + index; return the shard paths."""
    shards = plan_shards(specs, max_shard_bytes)
    total = sum(s.nbytes for s in specs)
    writer = _RandomWriter(seed)
    weight_map: dict[str, str] = {}
    paths = []
    with closing(writer), tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="writing weights",
              disable=not progress, dynamic_ncols=True) as bar:
        for k, shard in enumerate(shards, 1):
            path = out_dir / f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            with open(path, "wb") as f:
                f.write(_header(shard))
                writer.write(f, shard, bar)
            weight_map.update((spec.name, path.name) for spec in shard)
            paths.append(path)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return paths
