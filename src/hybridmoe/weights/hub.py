"""A model named by its Hugging Face repo id -> its files in the local Hub cache, downloaded there when missing.

`org/name` is a repo of config.json, tokenizer files and safetensors weights: the result is its snapshot
directory. `org/name:Q4_K_M` names the GGUF model of a repo whose file names hold the quant tag
(case-insensitive; a split model's parts together): the result is its first .gguf file. A revision picks a
branch, tag or commit hash (None: the default branch).

A path that exists always wins, and a string that is no repo id stays a path. The cache is read first: when it
holds every file a load reads for the revision, nothing goes over the network (a cached branch is not checked
for newer commits). Otherwise huggingface_hub downloads only those files, with its progress bars;
HF_HUB_OFFLINE=1 reads the cache alone. huggingface_hub (~0.1 s to import) is imported only for a lookup.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from hybridmoe.errors import CheckpointError
from hybridmoe.weights.expert_cache import MANIFEST
from hybridmoe.weights.safetensors import INDEX_NAME

REPO_REF = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?::(?P<quant>[\w.-]+))?")
"""org/name, or org/name:QUANT for a GGUF repo."""

METADATA_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "chat_template.jinja", "chat_template.json", "quantize_config.json",
                  "tiktoken.model", "tokenization_*.py", INDEX_NAME, MANIFEST]
"""The small files a load reads beside the weights (those the repo has are fetched); a tiktoken tokenizer's
tokenization_*.py is read for its regex, never run (tokenizer_tiktoken.py)."""


@dataclass(frozen=True)
class HubRef:
    """A model named on the Hub: its repo id, the quant tag of its GGUF files (None: safetensors), a revision."""

    repo_id: str
    quant: str | None = None
    revision: str | None = None


def parse_hub_ref(model: str, revision: str | None = None) -> HubRef | None:
    """org/name or org/name:QUANT -> a HubRef; None for anything else (a path, a .gguf file name)."""
    m = REPO_REF.fullmatch(model)
    if m is None or model.lower().endswith(".gguf"):
        return None
    return HubRef(m.group("repo"), m.group("quant"), revision)


def resolve_model_source(model: str | Path, revision: str | None = None) -> Path:
    """The local path model stands for: model itself when something exists there or it is no repo id; else the
    Hub repo's snapshot directory (org/name) or the first of its matching GGUF files (org/name:QUANT)."""
    path = Path(model)
    ref = None if path.exists() else parse_hub_ref(str(model), revision)
    return path if ref is None else fetch(ref, path)


def fetch(ref: HubRef, local: Path) -> Path:
    """ref's files from the cache, else (online) downloaded into it; a CheckpointError saying what was tried."""
    from huggingface_hub import constants
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    lookup = _Lookup(ref, local, offline=bool(constants.HF_HUB_OFFLINE), cache=str(constants.HF_HUB_CACHE))
    try:
        validate_repo_id(ref.repo_id)
    except HFValidationError as e:
        raise lookup.error(f"not a valid repo id ({_one_line(e)})") from None
    found, reason = _from_cache(ref)
    if found is not None:
        return found
    if lookup.offline:
        raise lookup.error(reason)
    return _download(ref, lookup)


def pick_gguf(names: list[str], quant: str) -> list[str]:
    """The repo files (names) of the one GGUF model quant names: the .gguf files whose paths hold quant,
    case-insensitive; a split model's parts (*-00001-of-00003.gguf, ...) count as one model. Where quant stands as
    a whole tag in some names (Q4_0 in model-Q4_0.gguf, not in model-Q4_0_4_4.gguf), only those count. Raises
    LookupError naming the files when none or several models match."""
    from hybridmoe.weights.gguf_file import SPLIT_NAME  # needs gguf, which only GGUF repos need

    ggufs = sorted(n for n in names if n.lower().endswith(".gguf") and not Path(n).name.lower().startswith("mmproj"))
    q = quant.lower()
    hits = [n for n in ggufs if q in n.lower()]
    whole = re.compile(rf"(?<![a-z0-9]){re.escape(q)}(?![a-z0-9_])")
    hits = [n for n in hits if whole.search(n.lower())] or hits
    models: dict[str, list[str]] = {}
    for name in hits:
        m = SPLIT_NAME.match(Path(name).name)
        key = str(Path(name).with_name(f"{m.group('stem')}-*-of-{m.group('count')}.gguf")) if m else name
        models.setdefault(key, []).append(name)
    if not models:
        raise LookupError(f"no .gguf file has {quant!r} in its name (its .gguf files: {_listing(ggufs)})")
    if len(models) > 1:
        raise LookupError(f"{quant!r} matches {len(models)} models ({_listing(sorted(models))}); give a longer tag")
    [(key, files)] = models.items()
    m = SPLIT_NAME.match(Path(files[0]).name)
    if m is not None and len(files) != int(m.group("count")):
        raise LookupError(f"{key} has {len(files)} of its {int(m.group('count'))} parts")
    return files


def weight_files(folder: Path, names: list[str]) -> list[str]:
    """The weight files a load of the repo reads, given its metadata files in folder and its file names: the
    safetensors index's shards (else every top-level .safetensors file), and a converted directory's experts."""
    try:
        files = sorted(set(json.loads((folder / INDEX_NAME).read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        files = [n for n in names if "/" not in n and n.endswith(".safetensors")]
    if MANIFEST in names:
        files += [n for n in names if n.startswith("experts/") and n.endswith(".safetensors")]
    return files


def _from_cache(ref: HubRef) -> tuple[Path | None, str]:
    """(the cached path, "") when the cache holds all ref's files; else (None, what is missing)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    patterns = [_any_case_glob(ref.quant)] if ref.quant else METADATA_FILES
    try:
        folder = Path(snapshot_download(ref.repo_id, revision=ref.revision, local_files_only=True,
                                        allow_patterns=patterns))
    except LocalEntryNotFoundError as e:  # its subclass IncompleteSnapshotError says which files are missing
        return None, "not in the cache" if type(e) is LocalEntryNotFoundError else _one_line(e)
    names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    try:
        missing, path = _missing(ref, folder, names)
    except LookupError as e:
        return None, f"in the cache at {folder}: {e}"
    if missing:
        return None, f"the cache at {folder} lacks {_listing(missing)}"
    return path, ""


def _missing(ref: HubRef, folder: Path, names: list[str]) -> tuple[list[str], Path]:
    """The files of ref that folder (a snapshot holding names) lacks, and the path a load of it reads."""
    if ref.quant:
        files = pick_gguf(names, ref.quant)
        return [], folder / files[0]
    if "config.json" not in names:
        _check_not_gguf_only(names)
        return ["config.json"], folder
    files = weight_files(folder, names) or ["*.safetensors"]
    return [f for f in files if f not in names], folder


def _download(ref: HubRef, lookup: _Lookup) -> Path:
    """ref's files fetched into the cache by huggingface_hub (with its progress bars), the path a load reads."""
    from huggingface_hub import snapshot_download

    try:
        if ref.quant:
            files = pick_gguf(_repo_files(ref.repo_id, ref.revision), ref.quant)
            return Path(snapshot_download(ref.repo_id, revision=ref.revision, allow_patterns=files)) / files[0]
        folder = Path(snapshot_download(ref.repo_id, revision=ref.revision, allow_patterns=METADATA_FILES))
        names = _repo_files(ref.repo_id, folder.name)  # the folder is the commit's snapshot
        if "config.json" not in names:
            _check_not_gguf_only(names)
            raise LookupError("the repo has no config.json")
        files = weight_files(folder, names)
        if not files:
            raise LookupError("the repo has no .safetensors file")
        snapshot_download(ref.repo_id, revision=folder.name, allow_patterns=files)
        return folder
    except LookupError as e:
        raise lookup.error(str(e)) from None
    except Exception as e:  # the Hub's answer (not found, gated, no network) ends the lookup, said in one line
        raise lookup.error(f"the download failed: {type(e).__name__}: {_one_line(e)}") from e


def _repo_files(repo_id: str, revision: str | None) -> list[str]:
    """The repo's file names at revision, from the Hub's model info (one request)."""
    from huggingface_hub import HfApi

    return [s.rfilename for s in HfApi().model_info(repo_id, revision=revision).siblings or []]


def _check_not_gguf_only(names: list[str]) -> None:
    ggufs = [n for n in names if n.lower().endswith(".gguf")]
    if ggufs:
        raise LookupError(f"no config.json, only .gguf files ({_listing(ggufs)}); name one as org/name:QUANT "
                          f"(e.g. :Q4_K_M)")


@dataclass(frozen=True)
class _Lookup:
    """What one lookup tries, for its error message."""

    ref: HubRef
    local: Path
    offline: bool
    cache: str

    def error(self, reason: str) -> CheckpointError:
        quant = f", .gguf files matching {self.ref.quant!r}" if self.ref.quant else ""
        mode = "offline (HF_HUB_OFFLINE=1)" if self.offline else "online"
        return CheckpointError(
            f"model {str(self.local)!r} not found: no file or directory at {self.local.absolute()}; Hugging Face repo "
            f"{self.ref.repo_id} (revision {self.ref.revision or 'main'}{quant}; {mode}; cache {self.cache}): "
            f"{_one_line(reason)}")


def _any_case_glob(quant: str) -> str:
    """Q4_K_M -> *[qQ]4_[kK]_[mM]*.gguf: huggingface_hub's patterns match case-sensitively."""
    return "*" + "".join(f"[{c.lower()}{c.upper()}]" if c.isalpha() else c for c in quant) + "*.gguf"


def _listing(names: list[str], most: int = 12) -> str:
    shown = ", ".join(names[:most])
    return (shown + f", ... ({len(names) - most} more)" if len(names) > most else shown) or "none"


def _one_line(text: object) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[0] if lines else type(text).__name__
