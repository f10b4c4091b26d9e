"""One download per model and cache: the flock around a fetch (common/hub/lock.py), with the
real fetch in two processes over a slow stand-in for the Hub below it."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time

from common.hub.lock import download_lock, lock_path
from tests.support.processes import ROOT

FETCH = (
    "import sys; from tests.common.hub.fake_hub import fetch_in_process as f; "
    "f(*sys.argv[1:3], 0.3)"
)


def _spawn(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_two_processes_download_once(tmp_path):
    cache, record = str(tmp_path / "cache"), str(tmp_path / "downloads")
    first = _spawn(FETCH, cache, record)
    time.sleep(0.5)  # the first holds the lock (its first file takes 0.3 s)
    second = _spawn(FETCH, cache, record)
    outs = [p.communicate(timeout=120) for p in (first, second)]
    assert [p.returncode for p in (first, second)] == [0, 0], outs
    assert outs[0][0] == outs[1][0]  # the same snapshot folder
    lines = open(record).read().split()
    names = collections.Counter(lines[1::2])
    assert set(names.values()) == {1}, names  # no file downloaded twice
    assert set(lines[0::2]) == {str(first.pid)}  # the second found everything cached
    assert "another process is downloading org/sharded; waiting" in outs[1][1]


HOLD = """
import sys, time
from common.hub.lock import download_lock
with download_lock(sys.argv[1], "x"):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_killed_holder_releases_the_lock(tmp_path):
    path = lock_path(str(tmp_path), "org/name", "main", "weights")
    holder = _spawn(HOLD, path)
    assert holder.stdout.readline().strip() == "held"
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=10)
    started = time.monotonic()
    with download_lock(path, "x") as held:
        assert held
    assert time.monotonic() - started < 5
    assert os.path.exists(path)  # left behind, and harmless: the kernel dropped the lock


def test_a_read_only_cache_needs_no_lock(tmp_path):
    path = lock_path(str(tmp_path / "file-not-dir"), "org/name", "", "config")
    (tmp_path / "file-not-dir").write_text("")  # the lock's folder cannot be created
    with download_lock(path, "x") as held:
        assert held is False


def test_lock_names_are_per_model_revision_and_kind(tmp_path):
    names = {
        lock_path("/c", "org/a", "main", "weights"),
        lock_path("/c", "org/a", "", "weights"),
        lock_path("/c", "org/a", "v1", "weights"),
        lock_path("/c", "org/a", "main", "config"),
        lock_path("/c", "org/b", "refs/pr/1", "weights"),
    }
    assert len(names) == 4  # "" is main
    assert all(os.path.dirname(n) == "/c/.locks/tandem" for n in names)
