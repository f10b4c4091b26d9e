"""Fake sampling: token ids and logprobs drawn without a model, reproducibly.

Greedy requests get a token that is a pure function of (prompt, position), and seeded requests
one of (seed, position), so the same request gives the same output after a preemption or on
another executor, as with a real model. Unseeded random requests draw from the session's
generator. Ending ids (EOS and the request's stop ids) are sampled only on purpose: with
probability ``eos_prob`` per token once ``min_tokens`` tokens are out.

A structured-output request's step brings its allowed tokens (packed bits, common.wire.
step_types.token_mask_bytes): the sampler keeps its usual token when the mask allows it, else
takes the first allowed token at or after it (wrapping), preferring tokens that do not end the
request; an ending token only when the grammar allows nothing else. So controller tests over
the simulator get grammar-valid output, still a deterministic function of the same inputs.
"""

from __future__ import annotations

import random

from common.wire.step_types import SamplingParams, TokenLogprobs, allowed_bits

_MASK = (1 << 64) - 1


def mix64(*values: int) -> int:
    """A 64-bit hash of integers (splitmix64 finalizer over a running combination)."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & _MASK
        h ^= h >> 29
    return h


def next_set_bit(bits: int, start: int) -> int:
    """The lowest set bit of ``bits`` at or after ``start``, else the lowest of all (wrapping);
    ``bits`` must not be 0."""
    high = bits >> start
    if high:
        return start + (high & -high).bit_length() - 1
    return (bits & -bits).bit_length() - 1


class FakeSampler:
    """Draws tokens and logprobs for simulated requests."""

    def __init__(
        self,
        vocab_size: int,
        eos_token_ids: list[int],
        seed: int = 0,
        eos_prob: float = 0.0,
        max_logprobs: int = 20,
    ):
        self.vocab_size = vocab_size  # tokens are drawn from [0, vocab_size)
        self.eos_token_ids = list(eos_token_ids)  # the model's ending ids
        self.eos_prob = eos_prob  # chance per token of ending once min_tokens are out
        self.max_logprobs = max_logprobs  # cap on top logprobs per position
        self.rng = random.Random(seed)  # the session's generator (unseeded requests)

    def reseed(self, seed: int) -> None:
        """Restart the session's generator (a new controller session)."""
        self.rng = random.Random(seed)

    def _draw(self, sampling: SamplingParams, prompt_key: int, position: int, salt: int) -> int:
        if sampling.seed is not None:
            return mix64(sampling.seed, position, salt)
        if sampling.greedy:
            return mix64(prompt_key, position, salt)
        return self.rng.getrandbits(64)

    def sample(
        self,
        sampling: SamplingParams,
        prompt_key: int,
        position: int,
        num_output_tokens: int,
        mask: bytes | None = None,
    ) -> int:
        """The token at ``position`` of a request whose prompt hashes to ``prompt_key``, among
        the tokens ``mask`` allows (None: any)."""
        token = self._unconstrained(sampling, prompt_key, position, num_output_tokens)
        if not mask:
            return token
        allowed = self.allowed_bits(mask)
        if allowed >> token & 1:
            return token
        ending = set(sampling.stop_token_ids).union(self.eos_token_ids)
        going_on = allowed
        for t in ending:
            going_on &= ~(1 << t)
        return next_set_bit(going_on or allowed, token)

    def allowed_bits(self, mask: bytes) -> int:
        """A packed mask as one integer whose bit t says whether token t is allowed (the
        little-endian words read as little-endian bytes), padding past the vocabulary off."""
        return allowed_bits(mask, self.vocab_size)

    def _unconstrained(
        self, sampling: SamplingParams, prompt_key: int, position: int, num_output_tokens: int
    ) -> int:
        ending = sampling.stop_token_ids or self.eos_token_ids
        if (
            self.eos_prob > 0
            and ending
            and num_output_tokens >= sampling.min_tokens
            and self._draw(sampling, prompt_key, position, 1) / _MASK < self.eos_prob
        ):
            return ending[self._draw(sampling, prompt_key, position, 2) % len(ending)]
        banned = set(ending).union(self.eos_token_ids)
        value = self._draw(sampling, prompt_key, position, 0)
        token = value % self.vocab_size
        while token in banned and len(banned) < self.vocab_size:
            token = (token + 1) % self.vocab_size
        return token

    def logprobs(
        self, token_id: int, num_top: int | None, allowed: int | None = None
    ) -> TokenLogprobs:
        """Made-up logprobs of ``token_id`` ranked first, plus ``num_top`` alternatives; with
        ``allowed`` (a mask's bits, see ``allowed_bits``) only allowed tokens, as many as
        there are (the constrained distribution)."""
        k = min(num_top or 0, self.max_logprobs)
        if allowed is not None:
            k = min(k, allowed.bit_count())
        logprob = -self.rng.random()
        top_ids = [token_id] if k else []
        top_lps = [logprob] if k else []
        current = logprob
        while len(top_ids) < k:
            candidate = self.rng.randrange(self.vocab_size)
            if allowed is not None:
                candidate = next_set_bit(allowed, candidate)
            if candidate in top_ids:
                continue
            current -= self.rng.random() + 0.01
            top_ids.append(candidate)
            top_lps.append(current)
        return TokenLogprobs(
            token_id=token_id, logprob=logprob, rank=1, top_token_ids=top_ids, top_logprobs=top_lps
        )

    def prompt_logprobs(self, target_ids: list[int], num_top: int) -> list[TokenLogprobs]:
        """Made-up logprobs of prompt tokens (each ranked at random) and their top tokens."""
        k = min(num_top, self.max_logprobs)
        out = []
        for target in target_ids:
            lp = self.logprobs(target, k)
            lp.logprob -= 2.0 * self.rng.random()
            lp.rank = 1 + self.rng.randrange(20)
            if k and lp.rank == 1:
                lp.top_logprobs[0] = lp.logprob
            elif k:  # someone else ranks first
                lp.top_token_ids[0] = (target + 1) % self.vocab_size
            out.append(lp)
        return out
