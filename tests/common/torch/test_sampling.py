"""Sampling semantics on small fabricated logits (no model needed)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from common.torch.sampling import (  # noqa: E402
    TOP_P_CANDIDATES,
    Sampler,
    apply_filters,
    apply_penalties,
    build_sampling_metadata,
    compute_logprobs,
    compute_prompt_logprobs,
    seed_key,
)
from common.wire.step_types import SamplingParams  # noqa: E402

V = 32


def _logits(rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * 3


def _sample(logits, params, positions=None, prompts=None, outputs=None, sampler=None):
    n = len(params)
    meta = build_sampling_metadata(
        params, positions or [10] * n, prompts or [[]] * n, outputs or [[]] * n, V, "cpu"
    )
    return (sampler or Sampler(0))(logits, meta), meta


def test_greedy_is_argmax():
    logits = _logits(5)
    out, _ = _sample(logits, [SamplingParams()] * 5)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.5, top_p=1e-6),
        SamplingParams(temperature=1.0, min_p=0.9999),
        SamplingParams(temperature=1e-4),
        SamplingParams(temperature=0.7, top_k=1, seed=3),
    ],
)
def test_degenerate_random_equals_greedy(params):
    logits = _logits(6, seed=1)
    out, _ = _sample(logits, [params] * 6)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_mixed_greedy_and_random_rows():
    logits = _logits(4, seed=2)
    params = [
        SamplingParams(),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(),
        SamplingParams(temperature=2.0, top_k=1, seed=5),
    ]
    out, _ = _sample(logits, params)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def _reference_filter(row, top_k, top_p, min_p):
    """Per-row reference: the set of tokens that may be sampled."""
    order = sorted(range(V), key=lambda t: -row[t].item())
    if top_k:
        order = order[:top_k]
    vals = torch.tensor([row[t].item() for t in order])
    probs = torch.softmax(vals, 0).tolist()
    kept, mass = [], 0.0
    for t, p in zip(order, probs):
        if mass > top_p:
            break
        kept.append(t)
        mass += p
    best = max(probs)
    if min_p:
        kept = [t for t, p in zip(order, probs) if t in kept and p >= min_p * best]
    return set(kept)


@pytest.mark.parametrize(
    "top_k,top_p,min_p",
    [(5, 1.0, 0.0), (0, 0.6, 0.0), (8, 0.8, 0.0), (0, 1.0, 0.2), (6, 0.9, 0.1), (1, 1.0, 0.0)],
)
def test_filters_match_reference(top_k, top_p, min_p):
    logits = _logits(8, seed=3)
    n = logits.shape[0]
    filtered = apply_filters(
        logits,
        torch.full((n,), top_k) if top_k else None,
        torch.full((n,), top_p) if top_p < 1.0 else None,
        torch.full((n,), min_p) if min_p else None,
    )
    for i in range(n):
        kept = set(torch.isfinite(filtered[i]).nonzero()[:, 0].tolist())
        assert kept == _reference_filter(logits[i], top_k, top_p, min_p)


def test_filters_per_row_parameters():
    logits = _logits(3, seed=4)
    filtered = apply_filters(logits, torch.tensor([0, 3, 1]), torch.tensor([1.0, 1.0, 0.5]), None)
    counts = torch.isfinite(filtered).sum(-1).tolist()
    assert counts[0] == V and counts[1] == 3 and counts[2] == 1


def test_sampled_tokens_respect_filters():
    logits = _logits(1, seed=5).repeat(400, 1)
    params = [SamplingParams(temperature=1.0, top_k=3, seed=9)] * 400
    out, _ = _sample(logits, params, positions=list(range(400)))
    allowed = set(logits[0].topk(3).indices.tolist())
    assert set(out.sampled_token_ids.tolist()) == allowed


def _reference_penalties(row, prompt, output, presence, frequency, repetition):
    row = row.clone()
    for t in set(prompt) | set(output):
        row[t] = row[t] / repetition if row[t] > 0 else row[t] * repetition
    for t in set(output):
        row[t] -= frequency * output.count(t) + presence
    return row


def test_penalties_match_reference():
    logits = _logits(4, seed=6)
    prompts = [[1, 2, 3], [4, 4, 5], [], [7]]
    outputs = [[3, 3, 9], [], [10, 11, 10, 10], [7, 7]]
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(),  # no penalties: unchanged
        SamplingParams(presence_penalty=-0.3, frequency_penalty=0.1, repetition_penalty=0.8),
    ]
    meta = build_sampling_metadata(params, [0] * 4, prompts, outputs, V, "cpu")
    got = apply_penalties(logits, meta)
    for i, p in enumerate(params):
        ref = _reference_penalties(
            logits[i],
            prompts[i],
            outputs[i],
            p.presence_penalty,
            p.frequency_penalty,
            p.repetition_penalty,
        )
        assert torch.allclose(got[i], ref, atol=1e-6)
    assert torch.equal(got[2], logits[2])


def test_greedy_applies_penalties():
    logits = torch.zeros(1, V)
    logits[0, 5] = 2.0
    logits[0, 6] = 1.9
    out, _ = _sample(logits, [SamplingParams(repetition_penalty=1.5)], prompts=[[5]])
    assert out.sampled_token_ids.tolist() == [6]


def test_seeded_same_seed_and_position_same_token():
    logits = _logits(1, seed=7).repeat(3, 1)
    p = SamplingParams(temperature=1.0, seed=42)
    first, _ = _sample(logits, [p, SamplingParams(temperature=1.0), p], positions=[5, 5, 5])
    tokens = first.sampled_token_ids.tolist()
    assert tokens[0] == tokens[2]
    # A different batch, row and sampler state: still the same token at that position.
    other = torch.cat([_logits(2, seed=8), logits[:1]])
    again, _ = _sample(
        other,
        [SamplingParams(temperature=1.0)] * 2 + [p],
        positions=[1, 2, 5],
        sampler=Sampler(123),
    )
    assert again.sampled_token_ids.tolist()[2] == tokens[0]


def test_seeded_different_seeds_or_positions_differ():
    logits = torch.zeros(64, V)  # uniform: the noise alone decides
    by_seed, _ = _sample(
        logits, [SamplingParams(temperature=1.0, seed=s) for s in range(64)], positions=[3] * 64
    )
    assert len(set(by_seed.sampled_token_ids.tolist())) > 10
    by_pos, _ = _sample(
        logits, [SamplingParams(temperature=1.0, seed=1)] * 64, positions=list(range(64))
    )
    assert len(set(by_pos.sampled_token_ids.tolist())) > 10


def test_seed_keys_differ():
    keys = {seed_key(s, p) for s in range(50) for p in range(50)}
    assert len(keys) == 2500 and all(0 <= k < 2**63 for k in keys)


def test_top_p_nucleus_beyond_candidates_falls_back_to_full_vocab():
    vocab = 4 * TOP_P_CANDIDATES
    logits = torch.zeros(2, vocab)  # flat: the 0.9 nucleus spans ~90% of the vocabulary
    logits[1, :3] = 10.0  # peaked: the nucleus is 3 tokens
    filtered = apply_filters(logits, None, torch.tensor([0.9, 0.9]), None)
    kept = torch.isfinite(filtered).sum(-1).tolist()
    assert kept[0] == pytest.approx(0.9 * vocab, abs=2) and kept[1] == 3


@pytest.mark.parametrize("seeded", [True, False])
def test_sampling_follows_softmax(seeded):
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    logits = torch.full((4000, V), -1e9)
    logits[:, :6] = base
    temp = 0.8
    params = [SamplingParams(temperature=temp, seed=11 if seeded else None)] * 4000
    out, _ = _sample(logits, params, positions=list(range(4000)))
    freq = torch.bincount(out.sampled_token_ids, minlength=V)[:6].float() / 4000
    expected = torch.softmax(base / temp, 0)
    assert (freq - expected).abs().max() < 0.03


def test_unseeded_rows_follow_executor_seed():
    logits = torch.zeros(8, V)
    params = [SamplingParams(temperature=1.0)] * 8
    a, _ = _sample(logits, params, sampler=Sampler(5))
    b, _ = _sample(logits, params, sampler=Sampler(5))
    assert torch.equal(a.sampled_token_ids, b.sampled_token_ids)


def test_logprobs_from_raw_logits():
    logits = _logits(3, seed=9)
    params = [
        SamplingParams(logprobs=2, repetition_penalty=2.0),
        SamplingParams(temperature=0.5, top_k=4, logprobs=0, seed=1),
        SamplingParams(),
    ]
    out, meta = _sample(logits, params, prompts=[[0, 1, 2]] * 3)
    ref = torch.log_softmax(logits, -1)
    lp = out.logprobs
    assert meta.max_num_logprobs == 2
    for i in range(3):
        tok = out.sampled_token_ids[i].item()
        assert lp.token_ids[i].item() == tok
        assert math.isclose(lp.logprobs[i].item(), ref[i, tok].item(), abs_tol=1e-5)
        assert lp.ranks[i].item() == int((ref[i] > ref[i, tok]).sum()) + 1
    objs = lp.to_token_logprobs(meta.num_logprobs)
    assert objs[2] is None
    assert objs[1].top_token_ids == [] and objs[1].rank >= 1
    assert objs[0].top_token_ids == ref[0].topk(2).indices.tolist()
    assert objs[0].top_logprobs == pytest.approx(ref[0].topk(2).values.tolist(), abs=1e-5)


def test_logprobs_capped_by_max_logprobs():
    meta = build_sampling_metadata(
        [SamplingParams(logprobs=50)], [0], [[]], [[]], V, "cpu", max_logprobs=5
    )
    assert meta.num_logprobs == [5] and meta.max_num_logprobs == 5


def test_prompt_logprobs_helper():
    logits = _logits(5, seed=10)
    targets = torch.tensor([3, 0, 31, 7, 7])
    got = compute_prompt_logprobs(logits, targets, 3)
    ref = torch.log_softmax(logits, -1)
    assert torch.allclose(got.logprobs, ref.gather(1, targets[:, None])[:, 0])
    assert torch.equal(got.top_ids, ref.topk(3).indices)
    for i in range(5):
        assert got.ranks[i].item() == int((ref[i] > ref[i, targets[i]]).sum()) + 1
    ranks_only = compute_logprobs(logits, targets, 0)
    assert ranks_only.top_ids.shape == (5, 0)


def test_min_tokens_suppresses_stop_ids_until_reached():
    logits = _logits(3)
    best = logits.argmax(dim=-1).tolist()
    params = [
        SamplingParams(min_tokens=5, stop_token_ids=[best[0]]),  # short: suppressed
        SamplingParams(min_tokens=5, stop_token_ids=[best[1]]),  # reached: allowed
        SamplingParams(stop_token_ids=[best[2]]),
    ]  # no min_tokens: allowed
    meta = build_sampling_metadata(
        params, [10] * 3, [[]] * 3, [[]] * 3, V, "cpu", num_outputs=[2, 5, 0]
    )
    out = Sampler(0)(logits, meta).sampled_token_ids.tolist()
    assert out[0] != best[0] and out[0] == logits[0].topk(2).indices[1].item()
    assert out[1:] == best[1:]


def test_a_given_argmax_is_taken_only_while_the_logits_are_unchanged():
    logits = _logits(4, seed=7)
    given = (logits.argmax(dim=-1) + 1) % V  # deliberately not the argmax: shows which is used
    plain = [SamplingParams(), SamplingParams(temperature=1.0, seed=1)] * 2
    meta = build_sampling_metadata(plain, [10] * 4, [[]] * 4, [[]] * 4, V, "cpu")
    out = Sampler(0)(logits, meta, given).sampled_token_ids
    assert out[0] == given[0] and out[2] == given[2]  # greedy rows: the caller's argmax
    changed = [
        [SamplingParams(repetition_penalty=1.5)] + [SamplingParams()] * 3,  # penalties
        [SamplingParams(min_tokens=3, stop_token_ids=[0])] + [SamplingParams()] * 3,
    ]
    for params in changed:
        out_ids = [[1, 2]] + [[]] * 3
        meta = build_sampling_metadata(
            params, [10] * 4, [[]] * 4, out_ids, V, "cpu", num_outputs=[1, 0, 0, 0]
        )
        assert meta.penalty_rows is not None or meta.suppress_rows is not None
        expected = Sampler(0)(logits, meta).sampled_token_ids
        assert torch.equal(Sampler(0)(logits, meta, given).sampled_token_ids, expected)
    allowed = bytes([0b1010, 0, 0, 0])  # tokens 1 and 3 (a 32-token vocabulary: 4 bytes)
    meta = build_sampling_metadata(
        [SamplingParams()] * 4, [10] * 4, [[]] * 4, [[]] * 4, V, "cpu", masks=[allowed] * 4
    )
    out = Sampler(0)(logits, meta, given).sampled_token_ids
    assert set(out.tolist()) <= {1, 3}
