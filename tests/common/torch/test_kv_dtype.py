"""--kv-cache-dtype on the GPU executor (on the CPU): the KV spec reports the real bytes per
block, so the same --kv-cache-bytes holds twice the blocks in bf16; the cache is allocated in
that dtype and serves; fp8 is refused at startup with a clear error."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from common.host.dtypes import DtypeError
from common.host.settings import ExecutorConfig
from common.torch.attention import torch_paged_attention
from common.wire.step_types import NewRequestData, SamplingParams, StepInput
from executor_gpu.worker import GPUWorker
from tests.executor_gpu.paged_cases import step_meta
from tests.support.processes import ROOT, model_dir

BUDGET = 64 * 2**20
BLOCK = 16

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU test; CUDA present")


def worker(**overrides) -> GPUWorker:
    cfg = ExecutorConfig(
        model=model_dir(),
        device="cpu",
        block_size=BLOCK,
        kv_cache_bytes=BUDGET,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        **overrides,
    )
    w = GPUWorker(cfg)
    w.init_device()
    return w


def test_bf16_cache_holds_twice_the_blocks_of_float32():
    f32 = worker().get_kv_cache_spec()
    bf16 = worker(kv_cache_dtype="bfloat16").get_kv_cache_spec()
    both = worker(dtype="bfloat16").get_kv_cache_spec()  # auto: the model's bf16
    g = (30, 3, 64)  # SmolLM2-135M: layers, KV heads, head size
    assert f32.dtype == "float32" and f32.bytes_per_block == 2 * BLOCK * g[1] * g[2] * 4 * g[0]
    assert bf16.dtype == both.dtype == "bfloat16"
    assert bf16.bytes_per_block == both.bytes_per_block == f32.bytes_per_block // 2
    # The controller's count (controller/fleet/client.py): the budget over the block's bytes.
    assert BUDGET // bf16.bytes_per_block == 2 * (BUDGET // f32.bytes_per_block)


def test_a_bf16_cache_is_allocated_in_bf16_and_serves():
    w = worker(kv_cache_dtype="bfloat16")
    w.load_model()
    spec = w.get_kv_cache_spec()
    num_blocks = w.determine_available_memory().available_kv_bytes // spec.bytes_per_block
    w.initialize_cache(num_blocks)
    caches = w.model_runner.kv_caches
    assert caches[0].dtype == torch.bfloat16
    assert sum(c.numel() * c.element_size() for c in caches) == num_blocks * spec.bytes_per_block
    assert w.model_runner.dtype == torch.float32  # weights stay float32 (the CPU's auto)
    prompt = list(range(10, 30))
    new = NewRequestData("a", prompt, [], SamplingParams(), [1, 2], 0, len(prompt))
    out = w.execute_model(StepInput(0, new_requests=[new]))
    assert not out.outputs[0].error and out.outputs[0].sampled_token_id is not None


def test_fp8_and_float16_are_refused_on_the_cpu():
    with pytest.raises(DtypeError, match="fp8 needs a CUDA device"):
        worker(kv_cache_dtype="fp8")
    with pytest.raises(DtypeError, match="float16 is not supported on the CPU"):
        worker(dtype="float16")


def test_fp8_is_refused_at_startup_with_exit_status_2():
    proc = subprocess.run(
        [sys.executable, "-m", "executor_gpu", "--model", model_dir(), "--device", "cpu"]
        + ["--port", "0", "--kv-cache-dtype", "fp8"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--kv-cache-dtype fp8 needs a CUDA device of compute capability 8.9" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_fp8_cache_is_stored_as_fp8_and_widened_on_read():
    """The mechanism CUDA >= 8.9 serves --kv-cache-dtype fp8 with (torch's attention; the
    executor refuses fp8 on the CPU by policy, but the arithmetic is the same here): keys and
    values stored as float8_e4m3fn, attention over them in the query's dtype."""
    fp8 = torch.float8_e4m3fn
    torch.manual_seed(0)
    meta = step_meta([40, 9, 23], [1, 1, 1], BLOCK, 64, seed=3)  # three decodes
    q, k, v = torch.randn(3, 9, 64), torch.randn(3, 3, 64), torch.randn(3, 3, 64)
    cache = torch.randn(2, 64, BLOCK, 3, 64).to(fp8)
    widened = cache.float()
    expected = torch_paged_attention(q, k.to(fp8).float(), v.to(fp8).float(), widened, meta, 0.125)
    meta.derived.clear()
    got = torch_paged_attention(q, k, v, cache, meta, 0.125)
    assert got.dtype == torch.float32
    assert torch.equal(cache.float(), widened)  # the new keys / values landed, as fp8
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
