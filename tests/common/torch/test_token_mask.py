"""Structured output in the sampler: allowed-token masks applied on the device before
sampling (common.torch.token_mask through common.torch.sampling), on fabricated logits."""

from __future__ import annotations

import math
import random

import pytest

torch = pytest.importorskip("torch")

from common.torch.sampling import Sampler, build_sampling_metadata  # noqa: E402
from common.torch.token_mask import mask_bias  # noqa: E402
from common.wire.step_types import SamplingParams  # noqa: E402
from tests.support.token_masks import pack_mask  # noqa: E402

V = 100  # not a multiple of 32: the last word has padding bits


def _logits(rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * 3


def _meta(params, masks, positions=None, outputs=None, num_outputs=None):
    n = len(params)
    return build_sampling_metadata(
        params,
        positions or [10] * n,
        [[1, 2]] * n,
        outputs or [[]] * n,
        V,
        "cpu",
        num_outputs=num_outputs,
        masks=masks,
    )


def _allowed(seed, count):
    return sorted(random.Random(seed).sample(range(V), count))


def test_unpacking_matches_the_wire_layout():
    allowed = [0, 1, 31, 32, 63, 64, 95, 99]
    mask = pack_mask(allowed, V)
    # Padding bits past the vocabulary (tokens 100..127) are set and must be dropped.
    padded = (int.from_bytes(mask, "little") | ((1 << 128) - (1 << 100))).to_bytes(16, "little")
    rows = torch.frombuffer(bytearray(mask + padded), dtype=torch.uint8).view(2, -1)
    got = mask_bias(rows, V, torch.float32)
    assert got.shape == (2, V) and set(got.unique().tolist()) == {0.0, -math.inf}
    for row in got:
        assert (row == 0).nonzero().flatten().tolist() == allowed


def test_a_step_without_masks_builds_nothing():
    meta = _meta([SamplingParams()] * 3, [None, b"", None])
    assert meta.masks is None and meta.mask_rows is None
    meta = _meta([SamplingParams()] * 2, None)
    assert meta.masks is None


def test_greedy_with_a_mask_takes_the_best_allowed_token():
    logits = _logits(4)
    masks = [pack_mask(_allowed(i, 1 + 7 * i), V) for i in range(4)]
    out = Sampler(0)(logits, _meta([SamplingParams()] * 4, masks))
    for i, token in enumerate(out.sampled_token_ids.tolist()):
        allowed = _allowed(i, 1 + 7 * i)
        assert token == max(allowed, key=lambda t: logits[i, t].item())


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=2.0, top_k=5),
        SamplingParams(temperature=1.5, top_p=0.5),
        SamplingParams(temperature=1.0, top_k=50, top_p=0.95, min_p=0.05),
        SamplingParams(temperature=1.0, presence_penalty=1.0, repetition_penalty=1.3),
        SamplingParams(temperature=5.0, seed=7),
    ],
)
def test_random_sampling_with_a_mask_draws_only_allowed_tokens(params):
    """Flat logits (every token likely) under high temperature: any leak would show."""
    logits = torch.zeros(8, V)
    logits[:, ::3] = 2.0  # the favourites are mostly disallowed below
    allowed = [[1 + 3 * j for j in range(i + 1)] for i in range(8)]
    masks = [pack_mask(a, V) for a in allowed]
    sampler = Sampler(0)
    for step in range(40):
        meta = _meta([params] * 8, masks, positions=[step] * 8, outputs=[[0, 3]] * 8)
        out = sampler(logits, meta).sampled_token_ids.tolist()
        assert all(t in a for t, a in zip(out, allowed)), (step, out)


def test_seeded_masked_rows_are_deterministic():
    logits = _logits(1, seed=2).repeat(3, 1)  # one distribution, two positions
    params = [SamplingParams(temperature=1.0, seed=11)] * 3
    masks = [pack_mask(_allowed(5, 40), V)] * 3
    first = Sampler(1)(logits, _meta(params, masks, positions=[5, 6, 5])).sampled_token_ids
    again = Sampler(2)(logits, _meta(params, masks, positions=[5, 6, 5])).sampled_token_ids
    assert torch.equal(first, again)
    assert first[0] == first[2] and all(t in _allowed(5, 40) for t in first.tolist())


def test_a_single_allowed_token_is_always_drawn():
    logits = _logits(6, seed=3)
    params = [SamplingParams(temperature=3.0, top_k=4, top_p=0.9, min_p=0.2)] * 6
    out = Sampler(0)(logits, _meta(params, [pack_mask([i * 17], V) for i in range(6)]))
    assert out.sampled_token_ids.tolist() == [i * 17 for i in range(6)]


def test_logprobs_of_a_masked_row_are_of_the_constrained_distribution():
    logits = _logits(2, seed=4)
    allowed = _allowed(9, 3)
    params = [SamplingParams(logprobs=5), SamplingParams(temperature=1.0, logprobs=5)]
    out = Sampler(0)(logits, _meta(params, [pack_mask(allowed, V), None]))
    masked, free = out.logprobs.to_token_logprobs([5, 5])
    # Only the 3 allowed tokens (probability > 0) are listed, and they hold the whole mass.
    assert sorted(masked.top_token_ids) == allowed
    assert math.isclose(sum(math.exp(lp) for lp in masked.top_logprobs), 1.0, rel_tol=1e-5)
    expected = torch.log_softmax(logits[0, allowed], dim=-1)
    assert masked.logprob == pytest.approx(expected.max().item(), rel=1e-5)
    assert masked.rank == 1 and masked.token_id == masked.top_token_ids[0]
    # The unmasked row's logprobs stay those of the raw distribution.
    raw = torch.log_softmax(logits[1], dim=-1)
    assert len(free.top_token_ids) == 5
    assert free.logprob == pytest.approx(raw[free.token_id].item(), rel=1e-5)


def test_mixed_masked_and_unmasked_rows():
    """Unmasked rows of a step with masks sample exactly as in a step without any."""
    logits = _logits(6, seed=5)
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=3, logprobs=2)] * 3
    masks = [None, None, pack_mask([4, 5], V), pack_mask([6], V), None, None]
    out = Sampler(0)(logits, _meta(params, masks))
    plain = Sampler(0)(logits, _meta(params, None))
    got, ref = out.sampled_token_ids.tolist(), plain.sampled_token_ids.tolist()
    assert [got[i] for i in (0, 1, 4, 5)] == [ref[i] for i in (0, 1, 4, 5)]
    assert got[2] in (4, 5) and got[3] == 6
    lps = out.logprobs.to_token_logprobs([None, 2, None, 2, None, 2])
    ref_lps = plain.logprobs.to_token_logprobs([None, 2, None, 2, None, 2])
    assert lps[1] == ref_lps[1] and lps[5] == ref_lps[5]
    assert lps[3].top_token_ids == [6] and lps[3].logprob == pytest.approx(0.0, abs=1e-6)


def test_a_grammar_allowing_only_a_stop_overrides_min_tokens():
    """min_tokens suppresses stop id 7, but the grammar allows nothing else: 7 is sampled;
    a row whose grammar allows more keeps the suppression."""
    logits = _logits(2, seed=6)
    params = [SamplingParams(min_tokens=5, stop_token_ids=[7])] * 2
    masks = [pack_mask([7], V), pack_mask([7, 8], V)]
    out = Sampler(0)(logits, _meta(params, masks, num_outputs=[0, 0]))
    assert out.sampled_token_ids.tolist() == [7, 8]
