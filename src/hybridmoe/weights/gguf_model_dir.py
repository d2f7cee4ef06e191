"""A .gguf path -> a small model directory that the rest of hybridmoe reads like a Hugging Face one.

The directory (under the cache directory, keyed by the GGUF files' path, size and mtime; a fresh
temporary one when caching is off) holds config.json and generation_config.json from the GGUF
metadata, tokenizer.json and tokenizer_config.json (chat template included) rebuilt from it, and
gguf_source.json naming the GGUF files, which the loader then reads the weights from.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from hybridmoe.config import EngineConfig
from hybridmoe.errors import CheckpointError
from hybridmoe.weights.expert_cache_policy import cache_root
from hybridmoe.weights.gguf_tokenizer import tokenizer_files
from hybridmoe.weights.hub import resolve_model_source


def is_gguf_path(path: str | Path) -> bool:
    return str(path).endswith(".gguf")


def resolve_model_path(path: str | Path, engine_config: EngineConfig | None = None) -> Path:
    """A model directory for path, the one place a user-given model is resolved: path itself when it exists; a
    Hugging Face repo id (org/name, or org/name:QUANT for GGUF files) resolved in the Hub cache at
    engine_config.revision (weights/hub.py); and for a .gguf file or split part, the directory made from it."""
    path = resolve_model_source(path, engine_config.revision if engine_config is not None else None)
    if not is_gguf_path(path):
        _check_model_dir(Path(path))
        return Path(path)
    # imported here: loading a Hugging Face directory needs no gguf package (nor its ~40 ms import)
    from hybridmoe.weights.gguf_file import split_paths

    parts = split_paths(path)
    h = hashlib.sha256()
    for p in parts:
        st = p.stat()
        h.update(f"{p.resolve()}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    root = cache_root(engine_config or EngineConfig())
    if root is None:
        out = Path(tempfile.mkdtemp(prefix="hybridmoe-gguf-"))
        write_model_dir(parts, out)
        return out
    out = root / "gguf" / h.hexdigest()[:32]
    if not (out / "gguf_source.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=".gguf-", dir=out.parent))
        write_model_dir(parts, stage)
        try:
            os.replace(stage, out)
        except OSError:  # another process made it first
            shutil.rmtree(stage, ignore_errors=True)
    return out


def _check_model_dir(path: Path) -> None:
    """The two near misses a model path can be, each with the path to pass instead: a file of a model
    directory, and a directory of GGUF files (which holds no config.json: the .gguf file is the model)."""
    if path.is_file():
        raise CheckpointError(f"{path} is a file; pass the model directory that holds it ({path.parent}) or a "
                              ".gguf file")
    ggufs = sorted(path.glob("*.gguf")) if path.is_dir() and not (path / "config.json").exists() else []
    if ggufs:
        raise CheckpointError(f"{path} holds GGUF files and no config.json; pass the .gguf file itself "
                              f"(e.g. {ggufs[0]}; for a split model, any of its parts)")


def write_model_dir(parts: list[Path], out: Path) -> None:
    from hybridmoe.weights.gguf_config import hf_config
    from hybridmoe.weights.gguf_file import GGUFFiles

    gguf = GGUFFiles(parts[0])
    config = hf_config(gguf)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=1))
    tok = tokenizer_files(gguf.metadata)
    if tok is not None:
        tokenizer, tokenizer_config = tok
        tokenizer.save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1, ensure_ascii=False))
    # gguf_source.json last: its presence marks a complete directory. The paths stay as named, links not followed:
    # a split model's parts in the Hub cache are links to blobs whose names say nothing of the split.
    (out / "gguf_source.json").write_text(json.dumps({"files": [os.path.abspath(p) for p in parts]}, indent=1))
