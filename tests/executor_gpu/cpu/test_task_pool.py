"""The kernels' thread pool (executor_gpu/cpu/task_pool.cpp): the same results on any number of
threads, helpers that take part, and callers that overlap or outnumber the cores."""

from __future__ import annotations

import threading

import pytest
import torch

from executor_gpu.cpu.kernels import load_kernels
from tests.executor_gpu.cpu.test_decoder_stack import bind_random_cache, run, tiny_model
from tests.executor_gpu.paged_cases import step_meta

pytestmark = pytest.mark.skipif(load_kernels() is None, reason="no C++ toolchain for the kernels")


def _weights(dtype: torch.dtype, depth: int, width: int, seed: int):
    m = load_kernels()
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(depth, width, generator=g) * 0.05).to(dtype)
    pairs = dtype == torch.bfloat16 and bool(m.bf16_dot_supported())
    return m.pack_linear_weight(weight, pairs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# 16 and 64: the last panels split into a row range per thread (9 panels); 400: several row
# ranges per panel
@pytest.mark.parametrize("rows", [1, 7, 16, 64, 400])
def test_packed_linear_is_identical_on_any_number_of_threads(threads, dtype, rows):
    m = load_kernels()
    packed = _weights(dtype, 96, 9 * 64, seed=rows)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    threads(1)
    alone = m.packed_linear(x, packed, None)
    for n in (2, 3, 5):  # 3 and 5 outnumber the cores here: helpers come late or not at all
        threads(n)
        for _ in range(20):
            assert torch.equal(m.packed_linear(x, packed, None), alone)


def test_helpers_take_part_in_large_jobs(threads):
    m = load_kernels()
    threads(2)
    packed = _weights(torch.float32, 512, 48 * 64, seed=0)
    x = torch.randn(256, 512)
    m.packed_linear(x, packed, None)  # starts the helper
    started, jobs, helped = m.task_pool_stats()
    assert started >= 1
    for _ in range(30):  # ~ms each: a helper that spins or wakes within that time joins
        m.packed_linear(x, packed, None)
    _, jobs_after, helped_after = m.task_pool_stats()
    assert jobs_after - jobs == 30
    assert helped_after > helped


def test_one_thread_runs_on_the_caller_alone(threads):
    m = load_kernels()
    threads(1)
    packed = _weights(torch.float32, 64, 4 * 64, seed=0)
    _, jobs, helped = m.task_pool_stats()
    m.packed_linear(torch.randn(8, 64), packed, None)
    assert m.task_pool_stats()[1:] == [jobs, helped]  # no job offered to a helper


def test_overlapping_callers_get_their_own_results(threads):
    """decoder_stack releases the GIL: callers on several Python threads overlap (one holds the
    pool, the others run alone), each with its own model, inputs and KV cache."""
    threads(2)
    lens, new = [9, 14, 40], [1, 1, 23]  # two decodes and a prefill chunk
    positions = torch.tensor([p for n, k in zip(lens, new) for p in range(n - k, n)])
    cases = []
    for seed in range(4):
        model = tiny_model(seed=seed)
        caches = bind_random_cache(model, seed)
        meta = step_meta(lens, new, 16, 40, seed=seed)
        ids = torch.randint(0, 320, (sum(new),), generator=torch.Generator().manual_seed(seed))
        cases.append((model, ids, positions, meta, caches))
    expected = [run(*case, stacked=True)[0] for case in cases]
    failures: list[str] = []

    def call(i: int) -> None:
        for _ in range(15):
            got = run(*cases[i], stacked=True)[0]
            if not torch.equal(got, expected[i]):
                failures.append(f"caller {i}")
                return

    workers = [threading.Thread(target=call, args=(i,)) for i in range(len(cases))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert failures == []
