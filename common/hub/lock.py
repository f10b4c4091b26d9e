"""One download of a model at a time per cache: an inter-process lock on a file in the cache.

fcntl.flock belongs to the open file: the kernel releases it when its holder exits, killed or
not, so a dead downloader never blocks the next one (the empty file staying behind locks
nothing). Executors on one node that share a cache thus download a model once: the second
waits, then finds the files cached.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

LOCK_FOLDER = os.path.join(".locks", "tandem")  # under the cache, beside huggingface_hub's
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def lock_path(cache_dir: str, repo_id: str, revision: str, purpose: str) -> str:
    """The lock file of one (model, revision) download of one kind (``purpose``)."""
    parts = ["models", *repo_id.split("/"), revision or "main", purpose]
    name = "--".join(_UNSAFE.sub("-", p) for p in parts)
    return os.path.join(cache_dir, LOCK_FOLDER, name + ".lock")


@contextmanager
def download_lock(path: str, what: str) -> Iterator[bool]:
    """Hold the lock at ``path`` (waiting for another holder, with a log line); yields
    whether it is held: False where the cache cannot be written (a read-only cache, which
    nothing can download into anyway)."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        log.debug("no download lock (%s): %s", path, e)
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is downloading %s; waiting for it", what)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)  # releases the lock
