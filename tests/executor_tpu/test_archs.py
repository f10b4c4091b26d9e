"""Every served architecture through the TPU executor on XLA:CPU, against transformers on a
tiny random checkpoint: greedy tokens with chunked prefill, recompute after preemption and a
prefix-cache hit (prompts past the sliding window), and nothing compiled after warm-up (the
windows, soft-caps and expert routing are part of the precompiled programs)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
torch = pytest.importorskip("torch")
pytest.importorskip("torch_xla")
pytest.importorskip("transformers")

from common.host.settings import ExecutorConfig  # noqa: E402
from executor_tpu.options import TPUOptions  # noqa: E402
from executor_tpu.worker import TPUWorker  # noqa: E402
from tests.support.mini_controller import BLOCK  # noqa: E402
from tests.support.tiny_models import KINDS, run_greedy_checks, save_tiny_checkpoint  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_tpu_runner_greedy_matches_transformers(tmp_path, kind):
    hf = save_tiny_checkpoint(kind, str(tmp_path / "model"))
    cfg = ExecutorConfig(
        model=str(tmp_path / "model"), block_size=BLOCK, seed=7, kv_cache_bytes=16 * 2**20
    )
    worker = TPUWorker(cfg, TPUOptions(compile_cache_dir=str(tmp_path / "xla-cache")))
    worker.init_device()
    worker.load_model()
    worker.configure(32, 4, 256)  # token buckets 16 / 32, request bucket 4
    worker.initialize_cache(64)
    runner = worker.model_runner
    checks = run_greedy_checks(runner, hf)
    print(f"{kind}: {checks.tokens} greedy tokens compared, mismatches: {checks.mismatches}")
    assert not checks.mismatches
    assert runner.compile_watch.after_warmup == 0
