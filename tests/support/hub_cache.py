"""A Hugging Face Hub cache built on disk the way huggingface_hub lays it out, for tests that
load models by id with HF_HUB_OFFLINE=1 (these machines reach no Hub):

    <cache>/models--ORG--NAME/blobs/<hash>                  file contents
    <cache>/models--ORG--NAME/snapshots/<commit>/<file>     -> ../../blobs/<hash>
    <cache>/models--ORG--NAME/refs/<branch>                 the branch's commit hash

Large files become symlinks to the source files (no copy of the weights).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

COPY_LIMIT = 1 << 20  # files up to this size are copied into blobs/; larger ones linked


def _commit(label: str) -> str:
    return hashlib.sha1(label.encode()).hexdigest()  # 40 hex digits, as a git commit


def _blob(storage: Path, source: Path) -> str:
    """Put ``source`` into blobs/ (copied, or linked when large); its blob name."""
    if source.stat().st_size <= COPY_LIMIT:
        digest = hashlib.sha256(source.read_bytes()).hexdigest()
    else:
        digest = hashlib.sha256(f"{source.resolve()}:{source.stat().st_size}".encode()).hexdigest()
    blob = storage / "blobs" / digest
    if not blob.exists():
        blob.parent.mkdir(parents=True, exist_ok=True)
        if source.stat().st_size <= COPY_LIMIT:
            shutil.copyfile(source, blob)
        else:
            blob.symlink_to(source.resolve())
    return digest


def add_snapshot(
    cache: Path,
    repo_id: str,
    files: dict[str, Path],
    label: str,
    branch: str | None = None,
) -> str:
    """A snapshot of ``repo_id`` holding ``files`` (repo path -> source file) under a commit
    named after ``label``; ``branch`` (e.g. "main") then points at it. Its commit hash."""
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    commit = _commit(f"{repo_id}:{label}")
    snapshot = storage / "snapshots" / commit
    for name, source in files.items():
        digest = _blob(storage, source)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(storage / "blobs" / digest, link.parent))
    if branch:
        ref = storage / "refs" / branch
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(commit)
    return commit


def checkpoint_files(model_dir: str | Path, drop: tuple[str, ...] = ()) -> dict[str, Path]:
    """Every file of a checkpoint directory, by name, but those in ``drop``."""
    root = Path(model_dir)
    return {
        str(p.relative_to(root)): p
        for p in sorted(root.rglob("*"))
        if p.is_file()
        if str(p.relative_to(root)) not in drop
    }


def edited_config(model_dir: str | Path, out: Path, **changes) -> Path:
    """A copy of the checkpoint's config.json with ``changes`` applied (None deletes a key)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(config))
    return out


def build_default_cache(cache: Path, repo_id: str, model_dir: str | Path) -> dict[str, str]:
    """The default model in ``cache`` as ``repo_id`` with two revisions: main (the checkpoint
    as it is) and a second commit whose config caps max_position_embeddings at 1024 (so a
    test can tell which one was loaded). Returns {"main": hash, "second": hash}."""
    files = checkpoint_files(model_dir)
    main = add_snapshot(cache, repo_id, files, "main", branch="main")
    config = edited_config(
        model_dir,
        cache.parent / f"{cache.name}-sources" / "config.json",
        max_position_embeddings=1024,
    )
    second = add_snapshot(cache, repo_id, {**files, "config.json": config}, "second")
    return {"main": main, "second": second}
