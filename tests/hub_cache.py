"""A Hugging Face Hub cache laid out by a test as huggingface_hub lays it out
(models--org--name/{blobs,snapshots/<commit>,refs/<ref>}), so that tests resolve repo ids offline."""

import hashlib
import os
from pathlib import Path


def put(cache: Path, repo_id: str, files: dict[str, bytes], commit: str, refs: tuple[str, ...] = ("main",)) -> Path:
    """files as one commit of repo_id in the cache: contents in blobs/, named through snapshots/<commit>/ links,
    each ref of refs pointing at the commit. Returns the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def directory_files(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def use_offline_cache(cache: Path, monkeypatch) -> Path:
    """Point huggingface_hub at cache, offline, for this test (cache made if missing)."""
    import huggingface_hub.constants as constants

    cache.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads both variables once, when first imported: an earlier import keeps its own values
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache
