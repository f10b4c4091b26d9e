"""The GPU executor's runner on the CPU, as the runner tests build it: a checkpoint loaded and
its KV blocks allocated, optionally with the decode-graph path run eagerly.

``TANDEM_TEST_DEVICE=cuda`` builds the same runners on a GPU instead, so that a lent GPU runs the
runner tests unchanged (with ``TRITON_INTERPRET=0``: compiled kernels)."""

from __future__ import annotations

import os
from typing import Any


def runner_device() -> str:
    """The device the runner tests build runners on: ``$TANDEM_TEST_DEVICE``, else the CPU."""
    return os.environ.get("TANDEM_TEST_DEVICE", "cpu")


def cpu_runner(path: str, num_blocks: int = 64, graphs: bool = False, **config: Any):
    """A loaded ``GPUModelRunner`` on the CPU over ``path`` (block size BLOCK, 8 requests and
    64 tokens a step unless ``config`` says otherwise); ``graphs``: the static-buffer decode
    replay path, run eagerly."""
    from common.host.settings import ExecutorConfig
    from common.wire.model_config import load_model_geometry
    from executor_gpu.model_runner import GPUModelRunner
    from tests.support.mini_controller import BLOCK

    settings = {"block_size": BLOCK, "max_num_seqs": 8, "max_num_batched_tokens": 64, **config}
    runner = GPUModelRunner(
        ExecutorConfig(model=path, device=runner_device(), **settings), load_model_geometry(path)
    )
    runner.load_model()
    runner.initialize_kv_cache(num_blocks)
    if graphs:
        runner.enable_decode_graphs(capture=False)
    return runner
