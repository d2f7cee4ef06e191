"""Write a random-weight Hugging Face checkpoint: config, generation config, tokenizer, sharded weights."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from hybridmoe.checkpoint.kimi_tokenizer import write_kimi_tokenizer
from hybridmoe.checkpoint.presets import OPTIONAL_KEYS, model_config, text_config_of
from hybridmoe.checkpoint.safetensors_writer import (
    DEFAULT_SHARD_BYTES,
    write_random_safetensors,
)
from hybridmoe.checkpoint.tensors import tensor_specs
from hybridmoe.checkpoint.tokenizer import write_tokenizer
from hybridmoe.errors import HybridMoEError

RANDOM_WEIGHTS_KEY = "hybridmoe_random_weights"
"""config.json's mark of a checkpoint written here: run, chat, serve and bench say its text is noise."""

_OUR_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tiktoken.model",
              "model.safetensors.index.json", "model.safetensors")

TIKTOKEN_ARCHS = ("kimi_k2", "kimi_k25")
"""Families whose tokenizer is a tiktoken.model (kimi_tokenizer.py), not a tokenizer.json."""


@dataclass(frozen=True)
class CheckpointSummary:
    out_dir: Path
    config: dict
    num_tensors: int
    total_bytes: int
    shards: list[Path]


def _prepare_out_dir(out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise HybridMoEError(f"--out {out} is a file, not a directory; pick a new directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise HybridMoEError(f"--out {out} exists and is not empty; pick a new directory or pass --force")
        # --force replaces a previous checkpoint's files only, never anything else in the directory
        for p in [*(out / f for f in _OUR_FILES), *out.glob("model-*-of-*.safetensors")]:
            p.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)


def _with_overrides(config: dict, overrides: dict, optional: tuple[str, ...] = ()) -> dict:
    """config with overrides applied to the text model's values (text_config's in a multimodal layout); optional:
    keys the preset leaves out that overrides may add (presets.py OPTIONAL_KEYS)."""
    text = text_config_of(config)
    unknown = sorted(set(overrides) - set(text) - set(optional))
    if unknown:
        raise HybridMoEError(f"cannot override {', '.join(unknown)}: not in this preset's config.json "
                             f"({', '.join(sorted({*text, *optional}))})")
    text.update(overrides)
    return config


def make_checkpoint(arch: str, preset: str, out: str | Path, *, layers: int | None = None, dtype: str = "bf16",
                    seed: int = 0, force: bool = False, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                    progress: bool = True, overrides: dict | None = None) -> CheckpointSummary:
    """Write `arch`/`preset` (cut to `layers`) with random weights drawn from `seed` into `out`.

    overrides: config.json values that replace the preset's (a smaller num_experts, say), keys of the preset or of
    the family's OPTIONAL_KEYS (mtp_num_hidden_layers: 1 writes Qwen3-Next's or Qwen3.5's multi-token-prediction
    module too); config.json carries RANDOM_WEIGHTS_KEY true."""
    config = _with_overrides(model_config(arch, preset, layers=layers, dtype=dtype), overrides or {},
                             OPTIONAL_KEYS.get(arch, ()))
    config[RANDOM_WEIGHTS_KEY] = True
    out = Path(out)
    specs = tensor_specs(config)
    total = sum(s.nbytes for s in specs)
    _prepare_out_dir(out, force)
    free = shutil.disk_usage(out).free
    if total > free:
        raise HybridMoEError(f"{arch} {preset} needs {total / 1e9:.1f} GB of weights but {out} has only "
                             f"{free / 1e9:.1f} GB free; use --layers to cut depth")
    text = text_config_of(config)
    if arch in TIKTOKEN_ARCHS:
        ids = write_kimi_tokenizer(out, text["vocab_size"])
    else:
        ids = write_tokenizer(out, arch, text["vocab_size"])
    stop_ids = ids["generation_eos"]
    generation_config = {"bos_token_id": ids["bos_token_id"],
                         "eos_token_id": stop_ids if len(stop_ids) > 1 else stop_ids[0],
                         "pad_token_id": ids["pad_token_id"]}
    for values in (config, text):  # a multimodal config.json names them in text_config too, as Kimi-K2.5's does
        values.update(bos_token_id=ids["bos_token_id"], eos_token_id=ids["eos_token_id"])
    shards = write_random_safetensors(out, specs, seed, max_shard_bytes=max_shard_bytes, progress=progress)
    (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    # config.json last: a directory with a config is a finished checkpoint
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return CheckpointSummary(out, config, len(specs), total, shards)
