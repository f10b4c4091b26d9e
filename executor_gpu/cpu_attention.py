"""The CPU's decode attention kernel (cpu_paged_attention.cpp), built on first use.

The kernel reads keys and values in place in the paged cache instead of gathering a padded copy
per step (see the .cpp file). It is compiled once with torch's C++ extension tooling into
~/.cache/tandem/torch_extensions (or $TANDEM_EXTENSIONS_DIR) and registered as the attention
backend "cpu_paged"; where it cannot be built (no compiler), the torch backend serves instead.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

import torch

from common.attention import (
    AttentionMetadata,
    paged_attention_with,
    register_attention_backend,
)

log = logging.getLogger(__name__)

BACKEND_NAME = "cpu_paged"
_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_paged_attention.cpp")
_lock = threading.Lock()
_state: dict[str, object] = {}  # "module" once built, "error" once failed


def _build_dir() -> str:
    root = os.environ.get("TANDEM_EXTENSIONS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "tandem", "torch_extensions")
    path = os.path.join(root, f"torch-{torch.__version__}")
    os.makedirs(path, exist_ok=True)
    return path


def load_kernel():
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
            module = load(name="tandem_cpu_paged_attention", sources=[_SOURCE],
                          extra_cflags=["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno"],
                          build_directory=_build_dir(), verbose=False)
        except Exception as exc:  # no compiler, no ninja, ...: the torch path serves
            _state["error"] = exc
            log.warning("CPU attention kernel unavailable (%s); using the torch backend", exc)
            return None
        _state["module"] = module
        return module


def decode_attention_of(module):
    """The decode attention of a built kernel module (bound once: no lookup per layer)."""
    kernel = module.paged_decode_attention

    def decode(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        """Single-token requests' attention, [N, heads, d]."""
        n = query.shape[0]
        return kernel(query.contiguous(), kv_cache, meta.block_tables[:n], meta.seq_lens[:n],
                      scale)

    return decode


def register() -> bool:
    """Build the kernel and register the "cpu_paged" backend; False if it cannot be built."""
    module = load_kernel()
    if module is None:
        return False
    register_attention_backend(BACKEND_NAME, paged_attention_with(decode_attention_of(module)))
    return True
