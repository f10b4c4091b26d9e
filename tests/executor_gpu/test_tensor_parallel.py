"""Tensor parallelism of the GPU executor, on the CPU (gloo): rank 0 in this process with the
real follower processes, the runner driven as an executor drives it.

Every served architecture's tiny checkpoint sharded over 2 ranks: logits within float
tolerance of the unsharded model's, and greedy tokens identical to transformers' through
chunked prefill, recompute after preemption and a prefix-cache hit. Over 4 ranks the tiny
models' 2 key/value heads are replicated (each on 2 ranks, one query head per rank). The
default model's sharding (9 query / 3 key-value heads: uneven) runs through the real
controller in tests/e2e/test_tensor_parallel.py.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


from common.host.settings import ExecutorConfig  # noqa: E402
from common.torch.input_batch import InputBatch, RequestState, ScheduledRow  # noqa: E402
from common.torch.models import build_model  # noqa: E402
from common.wire.model_config import load_model_geometry  # noqa: E402
from common.wire.step_types import NewRequestData, SamplingParams, StepInput  # noqa: E402
from executor_gpu.follower import start_sharded_runner  # noqa: E402
from executor_gpu.model_runner import GPUModelRunner  # noqa: E402
from tests.support.mini_controller import BLOCK  # noqa: E402
from tests.support.tiny_models import (  # noqa: E402
    KINDS,
    VOCAB,
    random_prompts,
    run_greedy_checks,
    save_tiny_checkpoint,
)
from tests.support.token_masks import pack_mask  # noqa: E402


def _start(path: str, size: int) -> GPUModelRunner:
    """Rank 0's runner over ``size`` ranks (followers started), loaded, with 64 blocks."""
    cfg = ExecutorConfig(
        model=path,
        device="cpu",
        block_size=BLOCK,
        seed=7,
        max_num_batched_tokens=64,
        tensor_parallel_size=size,
        num_threads=1,
    )
    runner = start_sharded_runner(cfg, load_model_geometry(path), torch.device("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(64)
    return runner


def _stop(runner: GPUModelRunner) -> None:
    assert runner.ranks is not None
    runner.ranks.close()


def _logits(model, state: RequestState, computed: int, count: int) -> torch.Tensor:
    ib = InputBatch(BLOCK, model.args.vocab_size, 1024, "cpu")
    batch = ib.build([ScheduledRow(state, computed, count, True, 0)])
    with torch.inference_mode():
        return model.compute_logits(model(batch.input_ids, batch.positions, batch.attn))


def _prefill_and_decode(model) -> torch.Tensor:
    """Logits of a 40-token prompt's last position, then of two decodes (KV cache reads)."""
    (ids,) = random_prompts(5, [42])
    state = RequestState("t", ids[:40], 40, list(range(1, 4)), SamplingParams())
    out = [_logits(model, state, 0, 40)]
    for tok in ids[40:]:
        state.token_ids.append(tok)
        out.append(_logits(model, state, len(state.token_ids) - 1, 1))
    return torch.cat(out)


@pytest.fixture(scope="module", params=list(KINDS))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tp-{request.param}")
    hf = save_tiny_checkpoint(request.param, str(path))
    return request.param, str(path), hf


def test_two_ranks_match_one_and_transformers(tiny):
    kind, path, hf = tiny
    single = build_model(path, torch.float32, "cpu")
    geometry = load_model_geometry(path)
    single.bind_kv_cache(
        [
            torch.zeros(2, 64, BLOCK, geometry.num_kv_heads, geometry.head_dim)
            for _ in range(geometry.num_layers)
        ]
    )
    runner = _start(path, 2)
    try:
        # Each rank holds one of the two KV heads; a block costs the executor what it costs
        # one device holding both.
        assert runner.local_kv_heads == 1 and runner.kv_caches[0].shape[3] == 1
        one = GPUModelRunner(ExecutorConfig(model=path, device="cpu", block_size=BLOCK), geometry)
        assert runner.get_kv_cache_spec() == one.get_kv_cache_spec()
        assert runner.get_capabilities().tensor_parallel_size == 2
        want = _prefill_and_decode(single)
        got = _prefill_and_decode(runner.model)
        diff = (got - want).abs().max().item()
        print(f"{kind}: TP=2 vs TP=1 max |logit diff| {diff:.3g}")
        assert diff < 1e-4 * max(1.0, want.abs().max().item())
        runner.model.bind_kv_cache(runner.kv_caches)
        checks = run_greedy_checks(runner, hf)
        print(f"{kind}: {checks.tokens} greedy tokens over 2 ranks, off: {checks.mismatches}")
        assert not checks.mismatches
    finally:
        _stop(runner)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3", "mixtral-window"])
def test_four_ranks_replicate_kv_heads(kind, tmp_path):
    hf = save_tiny_checkpoint(kind, str(tmp_path))
    runner = _start(str(tmp_path), 4)
    try:
        one = GPUModelRunner(
            ExecutorConfig(model=str(tmp_path), device="cpu", block_size=BLOCK),
            load_model_geometry(str(tmp_path)),
        )
        # 2 KV heads over 4 ranks: each stored twice, so a block costs twice as much.
        assert runner.stored_kv_heads() == 4
        assert runner.get_kv_cache_spec().bytes_per_block == (
            2 * one.get_kv_cache_spec().bytes_per_block
        )
        checks = run_greedy_checks(runner, hf)
        assert not checks.mismatches, checks.mismatches
    finally:
        _stop(runner)


def test_two_ranks_honour_token_masks(tmp_path):
    """Structured output under tensor parallelism (rank 0 samples from the gathered logits):
    a greedy masked row takes transformers' best allowed token, a random masked row draws an
    allowed one with constrained logprobs, an unmasked row in the same step is untouched."""
    hf = save_tiny_checkpoint("qwen3", str(tmp_path))
    (prompt,) = random_prompts(3, [20])
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt])).logits[0, -1].float()
    worst = logits.argsort()[:6].tolist()  # greedy would never pick these unmasked
    runner = _start(str(tmp_path), 2)
    try:
        hot = SamplingParams(temperature=1.0, top_p=0.9, seed=4, logprobs=5)
        requests = [
            NewRequestData(
                "g", prompt, [], SamplingParams(), [1, 2], 0, 20, pack_mask(worst, VOCAB)
            ),
            NewRequestData("r", prompt, [], hot, [3, 4], 0, 20, pack_mask(worst[:2], VOCAB)),
            NewRequestData("u", prompt, [], SamplingParams(), [5, 6], 0, 20),
        ]
        out = {o.request_id: o for o in runner.execute_model(StepInput(1, requests)).outputs}
        assert out["g"].sampled_token_id == max(worst, key=lambda t: logits[t].item())
        assert out["r"].sampled_token_id in worst[:2]
        assert set(out["r"].logprobs.top_token_ids) == set(worst[:2])
        assert out["u"].sampled_token_id == int(logits.argmax())
    finally:
        _stop(runner)


def test_kv_budget_is_bounded_by_the_rank_with_least_room():
    from executor_gpu.worker import kv_budget

    gib = 1 << 30

    def rank(free_gib: float, kv_heads: int) -> dict[str, int]:
        # 80 GiB devices, 10 GiB of weights and 2 of activations each, 1 GiB outside torch.
        reserved = 80 * gib - int(free_gib * gib) - gib
        return dict(
            total=80 * gib,
            free=int(free_gib * gib),
            reserved=reserved,
            weights=10 * gib,
            peak=2 * gib,
            kv_heads=kv_heads,
        )

    one = rank(60, 8)
    # One device: 80 * 0.9 - 10 - 2 - 1 = 59 GiB.
    assert kv_budget([one], 0.9, 1 << 20, 8) == 59 * gib
    # Two ranks of 4 heads each: every block costs each rank half its bytes; both have room
    # for 59 GiB of halves, i.e. 2 * 59 GiB of blocks.
    block = 1 << 20
    assert kv_budget([rank(60, 4), rank(60, 4)], 0.9, block, 8) == 2 * 59 * gib
    # Uneven heads (2 + 1 of 3): rank 0 stores 2/3 of each block and bounds the count.
    got = kv_budget([rank(60, 2), rank(60, 1)], 0.9, 3 * block, 3)
    assert got == (59 * gib // (2 * block)) * 3 * block
    # A rank with another process on its device (less free memory, more outside torch) bounds
    # the whole executor.
    crowded = dict(rank(60, 4), free=40 * gib)  # 20 GiB more held outside torch
    assert kv_budget([rank(60, 4), crowded], 0.9, block, 8) == 2 * 39 * gib
