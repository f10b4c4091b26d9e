"""Structured output in the GPU executor's runner (on the CPU): allowed-token masks of mixed
steps (a masked prefill chunk, masked and unmasked rows) and of pure decode steps through the
decode-replay path (the static buffers the CUDA graphs use, run eagerly here): sampling stays
outside the replayed part, so each step's own masks apply. Greedy tokens are checked against
transformers' logits restricted to the allowed tokens."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from common.wire.step_types import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    StepInput,
)
from tests.executor_gpu.cuda.test_decode_graphs import count_replays  # noqa: E402
from tests.support.cpu_runner import cpu_runner  # noqa: E402
from tests.support.tiny_models import VOCAB, random_prompts, save_tiny_checkpoint  # noqa: E402
from tests.support.token_masks import pack_mask  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mask-qwen3"))
    hf = save_tiny_checkpoint("qwen3", path)
    runner = cpu_runner(path, graphs=True)
    return runner, hf


def _best_allowed(hf, tokens: list[int], allowed: list[int]) -> int:
    with torch.inference_mode():
        logits = hf(torch.tensor([tokens])).logits[0, -1].float()
    return max(allowed, key=lambda t: logits[t].item())


def test_masked_greedy_through_chunks_mixed_steps_and_decode_replay(tiny):
    runner, hf = tiny
    replays = count_replays(runner)
    rng = random.Random(5)
    a, b, c = random_prompts(11, [30, 8, 8])
    seqs = {"a": list(a), "b": list(b), "c": list(c)}
    allowed = {rid: sorted(rng.sample(range(VOCAB), 40)) for rid in ("a", "b")}

    def masks(rid):
        return pack_mask(allowed[rid], VOCAB) if rid in allowed else None

    # Step 1: a's first chunk (no sample: its mask is ignored), b masked, c free.
    step = StepInput(
        1,
        new_requests=[
            NewRequestData("a", a, [], SamplingParams(), [1, 2, 3], 0, 16, masks("a")),
            NewRequestData("b", b, [], SamplingParams(logprobs=3), [4], 0, 8, masks("b")),
            NewRequestData("c", c, [], SamplingParams(), [5], 0, 8),
        ],
    )
    out = {o.request_id: o for o in runner.execute_model(step).outputs}
    assert not any(o.error for o in out.values()) and out["a"].sampled_token_id is None
    for rid in ("b", "c"):
        want = _best_allowed(hf, seqs[rid], allowed.get(rid, list(range(VOCAB))))
        assert out[rid].sampled_token_id == want, rid
        seqs[rid].append(want)
    assert set(out["b"].logprobs.top_token_ids) <= set(allowed["b"])
    # Step 2 (a's last chunk with b's and c's decodes), then pure decodes: new masks each step.
    computed = {"a": 16, "b": 8, "c": 8}
    for step_id in range(2, 7):
        allowed = {rid: sorted(rng.sample(range(VOCAB), 3 + step_id)) for rid in ("a", "b")}
        cached = [
            CachedRequestData(rid, [], computed[rid], len(seqs[rid]) - computed[rid], masks(rid))
            for rid in ("a", "b", "c")
        ]
        out = {
            o.request_id: o for o in runner.execute_model(StepInput(step_id, [], cached)).outputs
        }
        for rid in ("a", "b", "c"):
            want = _best_allowed(hf, seqs[rid], allowed.get(rid, list(range(VOCAB))))
            assert out[rid].sampled_token_id == want, (step_id, rid)
            computed[rid] = len(seqs[rid])
            seqs[rid].append(want)
    assert replays == [False, True, True, True, True]  # step 2 has a chunk: not replayed
