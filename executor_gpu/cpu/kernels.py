"""executor_gpu's CPU kernels (float32 and bfloat16), compiled on first use.

One C++ extension holds the attention over the paged cache (paged_attention.cpp) and
the model's fused per-layer elementwise ops (layer_ops.cpp). It is compiled once with
torch's C++ extension tooling into ~/.cache/tandem/torch_extensions (or
$TANDEM_EXTENSIONS_DIR); where it cannot be built (no compiler), the torch implementations
serve instead. ``make setup`` builds it ahead of the first executor start.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import sys
import threading

import torch

log = logging.getLogger(__name__)

_HERE = os.path.dirname(os.path.abspath(__file__))
_SOURCES = [
    os.path.join(_HERE, name)
    for name in (
        "kernels.cpp",
        "paged_attention.cpp",
        "layer_ops.cpp",
        "packed_linear.cpp",
        "decoder_stack.cpp",
        "task_pool.cpp",
        "logits_scan.cpp",
    )
]
# -fopenmp: at::parallel_for splits work over torch's OpenMP team (without it, it runs on one
# thread; the linker's libgomp.so.1 is the one torch already loaded); -fno-trapping-math lets
# branch-free selects vectorize.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]
_LDFLAGS = ["-fopenmp"]
_lock = threading.Lock()
_state: dict[str, object] = {}  # "module" once built, "error" once failed


def _build_dir() -> str:
    root = os.environ.get("TANDEM_EXTENSIONS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "tandem", "torch_extensions"
    )
    # One folder per checkout: two checkouts (or versions) of these sources never rebuild over
    # each other's objects, and each keeps its build across runs.
    source_key = hashlib.sha1(_HERE.encode()).hexdigest()[:10]
    path = os.path.join(root, f"torch-{torch.__version__}-{source_key}")
    os.makedirs(path, exist_ok=True)
    return path


@contextlib.contextmanager
def _build_lock(build_dir: str):
    """Hold the build directory for one builder at a time, across processes.

    torch's own guard is a ``lock`` file that a builder killed mid-compile leaves behind, and
    every later build then waits on it forever. An flock is released by the kernel when its
    holder dies, so while we hold it no live builder holds torch's file: one left there is
    stale and is removed.
    """
    with open(os.path.join(build_dir, "tandem-build.flock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = os.path.join(build_dir, "lock")
            if os.path.exists(stale):
                log.warning("removing a stale build lock left by a killed build: %s", stale)
                os.remove(stale)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def enabled() -> bool:
    """False when TANDEM_CPU_KERNELS=0 asks for the torch implementations."""
    return os.environ.get("TANDEM_CPU_KERNELS", "1") != "0"


def bf16_dot_enabled(module) -> bool:
    """Whether bf16 linear layers use the AVX-512 bf16 dot products (pair-interleaved panels):
    where the CPU has them (cpuid) unless TANDEM_CPU_BF16_DOT=0 asks for the float32-FMA path."""
    return os.environ.get("TANDEM_CPU_BF16_DOT", "1") != "0" and module.bf16_dot_supported()


def load_kernels():
    """The compiled extension module, or None when it cannot be built (logged once)."""
    with _lock:
        if "module" in _state or "error" in _state:
            return _state.get("module")
        try:
            from torch.utils.cpp_extension import load

            # The venv's bin (a pip-installed ninja) may not be on PATH.
            bin_dir = os.path.dirname(sys.executable)
            if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
                os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
            build_dir = _build_dir()
            with _build_lock(build_dir):
                module = load(
                    name="tandem_cpu_kernels",
                    sources=_SOURCES,
                    extra_cflags=_CFLAGS,
                    extra_ldflags=_LDFLAGS,
                    extra_include_paths=[_HERE],
                    build_directory=build_dir,
                    verbose=False,
                )
        except Exception as exc:  # no compiler, no ninja, ...: the torch path serves
            _state["error"] = exc
            log.warning("CPU kernels unavailable (%s); using the torch implementations", exc)
            return None
        _state["module"] = module
        return module
