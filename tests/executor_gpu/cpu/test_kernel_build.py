"""The CPU kernels' build survives a builder killed mid-compile (a stale torch lock file)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from executor_gpu.cpu import kernels


def test_build_lock_removes_a_stale_torch_lock(tmp_path):
    (tmp_path / "lock").touch()
    with kernels._build_lock(str(tmp_path)):
        assert not (tmp_path / "lock").exists()


def test_load_after_a_killed_build_does_not_wait_forever():
    """The build directory holds the lock a killed build leaves: a new process still loads."""
    if kernels.load_kernels() is None:
        pytest.skip("no C++ toolchain: the torch implementations serve")
    with open(os.path.join(kernels._build_dir(), "lock"), "w"):
        pass
    code = (
        "import sys; from executor_gpu.cpu.kernels import load_kernels; "
        "sys.exit(load_kernels() is None)"
    )
    done = subprocess.run([sys.executable, "-c", code], timeout=300)
    assert done.returncode == 0
