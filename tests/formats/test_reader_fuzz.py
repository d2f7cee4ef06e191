"""Fuzzed files (random byte flips and truncations of small files the tests write) either read or fail with
a one-line HybridMoEError, never another exception and never a read past the file: a GGUF (its tensors, and
the config made from its metadata), a safetensors header and a `convert` manifest (byte flips, and values
replaced by ones of other types)."""

import itertools
import json
import shutil
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from small_gguf import data_start, write_small_gguf

from hybridmoe.config import EngineConfig
from hybridmoe.engine.model_loader import load_model
from hybridmoe.errors import HybridMoEError
from hybridmoe.weights.convert import convert_checkpoint
from hybridmoe.weights.expert_cache import MANIFEST
from hybridmoe.weights.gguf_checkpoint import GGUFCheckpoint
from hybridmoe.weights.gguf_config import hf_config
from hybridmoe.weights.gguf_file import GGUFFiles
from hybridmoe.weights.safetensors import SafetensorsCheckpoint

FUZZ = settings(max_examples=50, deadline=None)
OLD_LAYOUT_WARNS = pytest.mark.filterwarnings("ignore:.*converted without per-expert checksums:UserWarning")
_names = itertools.count()


def damaged(raw: bytes, header: int, flips, cut) -> bytes:
    """raw with each (in_header, position, mask) XORed in (a position wraps into the first `header` bytes, or
    into the file), then cut short at `cut` (wrapped into the file) if given."""
    out = bytearray(raw)
    for in_header, at, mask in flips:
        out[at % (header if in_header else len(out))] ^= mask
    return bytes(out[:cut % len(out)] if cut is not None else out)


DAMAGE = (st.lists(st.tuples(st.booleans(), st.integers(0, 1 << 20), st.integers(1, 255)), min_size=1, max_size=6),
          st.one_of(st.none(), st.integers(0, 1 << 20)))
"""Up to 6 flipped bytes, about half of them in the header, and maybe a truncation."""


def fresh(root, suffix=""):
    return root / f"case-{next(_names)}{suffix}"


def reads_or_fails_cleanly(read, path) -> None:
    try:
        read(path)
    except HybridMoEError as e:
        assert "\n" not in str(e), str(e)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-gguf")
    write_small_gguf(root / "model.gguf")
    return root, (root / "model.gguf").read_bytes()


def read_gguf(path) -> None:
    files = GGUFFiles(path)
    for tensor, _ in files.tensors.values():
        assert tensor.data_offset + tensor.n_bytes <= path.stat().st_size
    hf_config(files)
    ckpt = GGUFCheckpoint(files)
    for names in ckpt.names_by_file().values():
        for name in names:
            assert tuple(ckpt.get(name).shape) == ckpt.shape(name)


@FUZZ
@given(*DAMAGE)
def test_a_damaged_gguf_reads_or_fails_cleanly(gguf_file, flips, cut):
    root, raw = gguf_file
    path = fresh(root, ".gguf")
    path.write_bytes(damaged(raw, data_start(raw), flips, cut))
    try:
        reads_or_fails_cleanly(read_gguf, path)
    finally:
        path.unlink()


@pytest.fixture(scope="module")
def safetensors_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-safetensors")
    tensors = {"a.weight": torch.randn(4, 8), "b.weight": torch.randn(3, 5).to(torch.bfloat16),
               "c.bias": torch.arange(6, dtype=torch.int64), "d.weight": torch.randn(2, 2).to(torch.float16)}
    save_file(tensors, root / "src.safetensors")
    return root, (root / "src.safetensors").read_bytes()


def read_safetensors(model_dir) -> None:
    with SafetensorsCheckpoint(model_dir) as ckpt:
        for name in ckpt.weight_names():
            ckpt.dtype(name)
            assert tuple(ckpt.get(name).shape) == ckpt.shape(name)


@FUZZ
@given(*DAMAGE)
def test_a_damaged_safetensors_header_reads_or_fails_cleanly(safetensors_file, flips, cut):
    root, raw = safetensors_file
    model_dir = fresh(root)
    model_dir.mkdir()
    (model_dir / "model.safetensors").write_bytes(damaged(raw, 8 + struct.unpack("<Q", raw[:8])[0], flips, cut))
    try:
        reads_or_fails_cleanly(read_safetensors, model_dir)
    finally:
        shutil.rmtree(model_dir)


@pytest.fixture(scope="module")
def converted(tiny_qwen3, tmp_path_factory):
    out = tmp_path_factory.mktemp("fuzz-manifest") / "conv"
    convert_checkpoint(tiny_qwen3, out, format="int4", group_size=32, threads=1, progress=False)
    return out, (out / MANIFEST).read_bytes()


def load_converted(path) -> None:
    load_model(path, EngineConfig(expert_backend="native", expert_format="int4", expert_group_size=32,
                                  cpu_threads=1, dtype="float32", cache_dir=""))


def check_load(converted_dir, original: bytes, manifest: bytes) -> None:
    (converted_dir / MANIFEST).write_bytes(manifest)
    try:
        reads_or_fails_cleanly(load_converted, converted_dir)
    finally:
        (converted_dir / MANIFEST).write_bytes(original)


@OLD_LAYOUT_WARNS
@FUZZ
@given(*DAMAGE)
def test_a_manifest_with_flipped_bytes_loads_or_fails_cleanly(converted, flips, cut):
    out, raw = converted
    check_load(out, raw, damaged(raw, len(raw), flips, cut))


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False)
                           | st.text(max_size=8), lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=6)


def key_paths(node, prefix=()):
    """Every key path (a tuple of keys and list indices) in a JSON tree."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in items:
        yield prefix + (key,)
        yield from key_paths(child, prefix + (key,))


def replace_at(node, path, value) -> None:
    """Set the value at key path in a JSON tree, if the path still leads somewhere (an earlier replacement may
    have cut it)."""
    *parents, last = path
    for key in parents:
        if not holds(node, key):
            return
        node = node[key]
    if holds(node, last):
        node[last] = value


def holds(node, key) -> bool:
    return isinstance(node, dict) and key in node or isinstance(node, list) and isinstance(key, int) and key < len(node)


@OLD_LAYOUT_WARNS
@FUZZ
@given(st.data())
def test_a_manifest_value_of_another_type_loads_or_fails_cleanly(converted, data):
    out, raw = converted
    manifest = json.loads(raw)
    paths = list(key_paths(manifest))
    for _ in range(data.draw(st.integers(1, 3))):
        replace_at(manifest, data.draw(st.sampled_from(paths)), data.draw(JSON_VALUES))
    check_load(out, raw, json.dumps(manifest).encode())


def test_the_undamaged_files_read(gguf_file, safetensors_file, converted, tmp_path):
    read_gguf(gguf_file[0] / "model.gguf")
    (tmp_path / "model.safetensors").write_bytes(safetensors_file[1])
    read_safetensors(tmp_path)
    load_converted(converted[0])
