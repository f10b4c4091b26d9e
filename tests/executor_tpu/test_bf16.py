"""The TPU executor in bfloat16 on XLA:CPU: --dtype bfloat16 asked for explicitly (auto is
float32 on XLA:CPU, the checkpoint's dtype on a TPU), warm-up compiles every shape, requests
are served from the precompiled programs, the KV cache is bf16 and its blocks take half the
bytes of float32 ones."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
torch = pytest.importorskip("torch")
pytest.importorskip("torch_xla")

from common.host.settings import ExecutorConfig  # noqa: E402
from executor_tpu.compile_watch import CompileStats  # noqa: E402
from executor_tpu.options import TPUOptions  # noqa: E402
from executor_tpu.worker import TPUWorker  # noqa: E402
from tests.support.mini_controller import MODEL_DIR, MiniController, needs_model  # noqa: E402

BLOCK = 16

pytestmark = needs_model


def worker(tmp_path, dtype: str) -> TPUWorker:
    cfg = ExecutorConfig(
        model=MODEL_DIR,
        block_size=BLOCK,
        max_model_len=256,
        kv_cache_bytes=32 * 2**20,
        dtype=dtype,
    )
    w = TPUWorker(cfg, TPUOptions(compile_cache_dir=str(tmp_path)))
    w.init_device()
    return w


def test_auto_is_float32_on_xla_cpu(tmp_path):
    w = worker(tmp_path, "auto")
    assert w.model_runner.dtype == torch.float32
    assert w.get_kv_cache_spec().dtype == "float32"


def test_bf16_warms_up_and_serves_without_compiling(tmp_path):
    f32_block = worker(tmp_path, "float32").get_kv_cache_spec().bytes_per_block
    w = worker(tmp_path, "bfloat16")
    spec = w.get_kv_cache_spec()
    assert spec.dtype == "bfloat16" and spec.bytes_per_block == f32_block // 2
    w.load_model()
    # 4 requests a step: a request bucket no other test uses, so that this process's XLA cache
    # (shared by the tests) holds no sampling program another test counts at its warm-up.
    w.configure(32, 4, 256)
    _, graphs = w.initialize_cache(32)
    assert graphs > 0
    runner = w.model_runner
    assert runner.kv_caches[0].dtype == torch.bfloat16
    assert next(runner.model.parameters()).dtype == torch.bfloat16
    baseline = CompileStats.now().count
    ctl = MiniController(runner, budget=32, num_blocks=32)
    # "What is the capital of France?" in the chat template, as tokens; and a second prompt.
    tok = __import__("transformers").AutoTokenizer.from_pretrained(MODEL_DIR)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
    )
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    first = ctl.add("a", ids, max_tokens=8)
    second = ctl.add("b", list(range(100, 140)), max_tokens=4)  # chunked over two steps
    ctl.run()
    assert len(first.output) == 8 and len(second.output) == 4
    assert "Paris" in tok.decode(first.output)
    assert CompileStats.now().count == baseline  # served from the warm-up's programs
