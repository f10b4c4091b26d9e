"""The model runner's mixed step (decodes, a chunk continuing a chunked prefill, a prefix-cache
hit's new chunk, a fresh prompt) through the Triton backend with the batched prefill kernel,
against the same step through the torch backend, on the CPU under Triton's interpreter (or
compiled on a GPU with ``TANDEM_TEST_DEVICE=cuda TRITON_INTERPRET=0``).

A tiny random-weight Llama (2 layers, GQA 4/2, 32-wide heads), float32. tests/conftest.py sets
``TRITON_INTERPRET=1`` before triton is imported.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

triton = pytest.importorskip("triton")

from tests.support.cpu_runner import runner_device  # noqa: E402

# conftest sets the interpreter before triton loads; a GPU run compiles the kernels instead
if os.environ.get("TRITON_INTERPRET") != "1" and runner_device() == "cpu":
    pytest.skip(
        "TRITON_INTERPRET=1 was not set before triton was imported", allow_module_level=True
    )

from common.host.settings import ExecutorConfig  # noqa: E402
from common.torch.runner import DUMMY_SAMPLING  # noqa: E402
from common.wire.model_config import load_model_geometry  # noqa: E402
from common.wire.step_types import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    StepInput,
)
from executor_gpu.cuda import triton_attention  # noqa: E402
from executor_gpu.model_runner import GPUModelRunner  # noqa: E402

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "eos_token_id": 0,
}
BS = 16  # tokens per block (the default)


@pytest.fixture
def runner(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CPU_KERNELS", "0")  # the torch implementations on the CPU
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    cfg = ExecutorConfig(
        model=str(tmp_path),
        device=runner_device(),
        dtype="float32",
        max_num_seqs=8,
        load_format="dummy",
    )
    r = GPUModelRunner(cfg, load_model_geometry(str(tmp_path), 256))
    r.load_model()
    r.initialize_kv_cache(32)
    triton_attention.register()
    return r


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(1, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_mixed_step_matches_the_torch_backend(runner):
    a, b, c = prompt(1, 20), prompt(2, 13), prompt(3, 30)
    d = a[:16] + prompt(4, 9)  # shares a's first block: a prefix-cache hit of 16 tokens
    # Step 0: a and b whole, c's first 17 tokens (a chunked prefill).
    runner.execute_model(
        StepInput(
            0,
            new_requests=[
                NewRequestData("a", a, [], SamplingParams(), [1, 2], 0, 20),
                NewRequestData("b", b, [], SamplingParams(), [3], 0, 13),
                NewRequestData("c", c, [], SamplingParams(), [9, 5], 0, 17),
            ],
        )
    )
    # Step 1: a and b decode; c's remaining 13 tokens start mid-block; d computes its 9 new
    # tokens after the cached block it shares with a.
    step = StepInput(
        1,
        new_requests=[NewRequestData("d", d, [], SamplingParams(), [1, 7], 16, 9)],
        cached_requests=[
            CachedRequestData("a", [], 20, 1),
            CachedRequestData("b", [], 13, 1),
            CachedRequestData("c", [], 17, 13),
        ],
    )
    rows, errors = runner.input_batch.schedule(step)
    assert not errors and [r.num_scheduled for r in rows] == [1, 1, 9, 13]
    batch = runner.input_batch.build(rows)
    caches = [cache.clone() for cache in runner.kv_caches]
    results = {}
    for name in ("torch", triton_attention.BACKEND_NAME):
        for cache, saved in zip(runner.kv_caches, caches):
            cache.copy_(saved)
        runner.model.set_attention_backend(name)
        batch.attn.derived.clear()
        with torch.inference_mode():
            hidden = runner.model(batch.input_ids, batch.positions, batch.attn)
            logits = runner.model.compute_logits(hidden[batch.logits_indices])
        results[name] = (hidden, logits, [cache.clone() for cache in runner.kv_caches])
    hidden, logits, kv = results["torch"]
    new_hidden, new_logits, new_kv = results[triton_attention.BACKEND_NAME]
    assert logits.shape[0] == 4  # every row samples
    torch.testing.assert_close(new_hidden, hidden, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(new_logits, logits, rtol=1e-4, atol=1e-4)
    for got, expected in zip(new_kv, kv):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert new_logits.argmax(-1).tolist() == logits.argmax(-1).tolist()


def test_profiling_pass_runs_the_kernel_without_a_cache(runner):
    """Prefill shapes before the cache exists (dummy_run): the kernel reads the step's own keys
    and values, and agrees with the torch backend."""
    rows = runner.dummy_rows(40, 3, 0, DUMMY_SAMPLING)
    batch = runner.input_batch.build(rows)
    runner.model.bind_kv_cache(None)
    hidden = {}
    for name in ("torch", triton_attention.BACKEND_NAME):
        runner.model.set_attention_backend(name)
        batch.attn.derived.clear()
        with torch.inference_mode():
            hidden[name] = runner.model(batch.input_ids, batch.positions, batch.attn)
    torch.testing.assert_close(
        hidden[triton_attention.BACKEND_NAME], hidden["torch"], rtol=1e-4, atol=1e-4
    )
    runner.model.bind_kv_cache(runner.kv_caches)
    with torch.inference_mode():
        runner.dummy_run(40, 3)  # the profiling pass itself, through the kernel
