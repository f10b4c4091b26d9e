"""Placement: which executor of the fleet takes a request.

Every healthy executor that can hold the request is a candidate. For each, the controller knows
exactly how many of the request's tokens are already cached there (its own block hashes over
the executor's block pool, plus the prompts already queued there, whose blocks will be cached
before this request is admitted), how loaded it is (tokens not computed yet, output tokens still
expected, free KV blocks) and how fast it is (a step-cost model fitted on its own measured
steps: seconds ~ overhead + per_token * tokens). Prefill of P tokens costs
per_token * P + overhead * P / budget (it runs in steps of at most `budget` tokens).

Balance: each candidate's backlog is estimated in seconds, with this request added:

    backlog = prefill(uncomputed tokens queued there + this request's uncached tokens)
            + (overhead / B + per_token) * (output tokens expected there + this request's)
            (+ this request's decode again if its KV blocks do not fit)

B is a reference batch common to all candidates (the fleet's mean requests per executor, plus
one), so the per-token decode cost compares executors at the same operating point. The smallest
backlog wins: backlogs equalize, so each executor receives work in proportion to its measured
speed, and noise in one executor's measurements shifts the split a little, never tips it.

Affinity: when another candidate holds a longer cached prefix, it wins instead if the request's
own expected latency there (prefill queued ahead of it, its uncached prefill, its decode at that
executor's batch) exceeds its latency on the balance winner by at most `affinity_max_wait`
seconds. The bound is enforced again after placement: a request that its executor has not
admitted within `affinity_max_wait` moves to one that can start it at once
(`Maintenance._rebalance`, maintenance.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from controller.core.snapshot import ExecutorSnapshot

# Where the prior's second pseudo-step sits (tokens), so that the prior pins a slope.
_PRIOR_TOKENS = 256
_MIN_STEP_BUDGET = 128  # fewest tokens StepCostModel.step_budget leaves a step


@dataclass
class StepCostModel:
    """The measured step time of one executor: seconds ~ overhead + per_token * tokens.

    An exponentially weighted least-squares fit over the executor's recent steps (wall time
    seen by the controller, so network and host overheads count). It starts from a prior
    (two pseudo-steps on the prior's line) that fades like any old step: decode steps (a few
    tokens each) pin the level, prefill steps (many tokens) the slope, and while only one
    kind has been seen the prior still shapes the other.
    """

    prior_overhead: float = 0.03  # seconds of a near-empty step before any measurement
    prior_per_token: float = 0.002  # seconds per scheduled token before any measurement
    prior_weight: float = 2.0  # pseudo-steps the prior starts with
    decay: float = 0.97  # weight an older step keeps per newer step (about 30 steps' memory)
    steps: int = 0  # steps observed
    _sums: list[float] | None = None  # decayed sums: weight, x, y, x*x, x*y
    _tokens: float = 0.0  # decayed tokens, for the throughput figure
    _seconds: float = 0.0  # decayed busy seconds, for the throughput figure
    _fit: tuple[float, float] | None = None  # cached (overhead, per_token)

    def __post_init__(self) -> None:
        self.set_prior(self.prior_overhead, self.prior_per_token)

    def set_prior(self, overhead: float, per_token: float) -> None:
        """Start over from a prior (e.g. the fleet's average, for an executor not seen yet)."""
        self.prior_overhead = max(overhead, 0.0)
        self.prior_per_token = max(per_token, 1e-7)
        self._sums = [0.0] * 5
        for x in (1.0, float(_PRIOR_TOKENS)):
            self._add(x, self.prior_overhead + self.prior_per_token * x, self.prior_weight / 2)
        self._fit = None

    def _add(self, x: float, y: float, w: float) -> None:
        sums = self._sums
        assert sums is not None
        for i, v in enumerate((w, w * x, w * y, w * x * x, w * x * y)):
            sums[i] += v

    def observe(self, tokens: int, seconds: float) -> None:
        """Fold in one step of `tokens` scheduled tokens that took `seconds`."""
        if tokens <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        d = self.decay
        self._sums = [v * d for v in self._sums or [0.0] * 5]
        self._add(float(tokens), seconds, 1.0)
        self._tokens = self._tokens * d + tokens
        self._seconds = self._seconds * d + seconds
        self.steps += 1
        self._fit = None

    def coefficients(self) -> tuple[float, float]:
        """(overhead seconds, seconds per token), both positive."""
        if self._fit is not None:
            return self._fit
        assert self._sums is not None
        w, sx, sy, sxx, sxy = self._sums
        var = sxx - sx * sx / w
        slope = (sxy - sx * sy / w) / var if var > 1e-12 * w else self.prior_per_token
        slope = max(slope, 1e-7)
        intercept = (sy - slope * sx) / w
        if intercept < 0:  # the data says "no overhead": fit through the origin
            intercept, slope = 0.0, max(sxy / sxx, 1e-7)
        self._fit = (intercept, slope)
        return self._fit

    def step_seconds(self, tokens: int) -> float:
        """Predicted wall time of a step of `tokens` tokens."""
        overhead, per_token = self.coefficients()
        return overhead + per_token * tokens

    def tokens_within(self, seconds: float) -> int:
        """The most tokens a step may schedule and still be predicted to take `seconds`."""
        overhead, per_token = self.coefficients()
        return max(0, int((seconds - overhead) / per_token))

    def step_budget(self, seconds: float, full: int, needed: int) -> int:
        """The token budget that keeps steps near `seconds` by the measured cost: a slow
        device (a CPU, where 2048 prefill tokens take seconds) computes long prompts in more,
        shorter steps, so that running requests' next tokens and new arrivals' first ones do
        not wait behind one long step. Never below `needed` (the running requests' decodes)
        or a floor, never above the configured budget `full`."""
        floor = min(full, max(_MIN_STEP_BUDGET, needed))
        return max(floor, min(full, self.tokens_within(seconds)))

    @property
    def tokens_per_second(self) -> float:
        """Tokens computed per busy second, recent steps weighted most (0 before any step)."""
        return self._tokens / self._seconds if self._seconds > 0 else 0.0


@dataclass
class PlacementQuery:
    """The request being placed."""

    num_tokens: int  # tokens to compute: the prompt, plus the output so far when resumed
    expected_output: int  # tokens it is expected to generate from here (at least 1)
    reference_batch: float = 1.0  # batch at which decode costs are compared (fleet mean + 1)


@dataclass
class Candidate:
    """What placement knows about one executor that could take the request."""

    key: str  # the executor's address
    prefix_hit: int  # tokens of this request cached there (or queued there), exact
    num_requests: int  # requests placed there and not finished
    uncomputed_tokens: int  # tokens of those requests not computed yet (queued prefill)
    decode_tokens: int  # output tokens those requests are still expected to generate
    max_num_seqs: int  # most requests in one of its steps
    max_num_batched_tokens: int  # most tokens in one of its steps
    free_blocks: int  # KV blocks no request holds
    block_size: int  # tokens per KV block
    overhead: float  # measured seconds of a near-empty step
    per_token: float  # measured seconds per token in a step
    placed: int = 0  # requests placed there so far (tie-break: spreads equal candidates)


@dataclass
class PlacementDecision:
    """Where a request goes and why."""

    key: str  # the chosen executor's address
    reason: str  # "affinity": it holds the longest cached prefix (> 0); else "load"
    prefix_hit: int  # tokens of the request cached there
    latency: float  # the request's estimated latency there, seconds
    balance_latency: float  # its estimated latency on the balance winner (affinity's cost)


class PlacementPolicy:
    """Scores candidates by estimated completion time; prefix affinity within a bound."""

    def __init__(self, prefix_affinity: bool = True, affinity_max_wait: float = 2.0):
        self.prefix_affinity = prefix_affinity  # prefer the longest cached prefix at all
        self.affinity_max_wait = affinity_max_wait  # most extra seconds affinity may cost

    @staticmethod
    def prefill_seconds(c: Candidate, tokens: int) -> float:
        """Seconds `tokens` of prefill take on `c`, in steps of its token budget."""
        if tokens <= 0:
            return 0.0
        steps = math.ceil(tokens / max(c.max_num_batched_tokens, 1))
        return c.per_token * tokens + c.overhead * steps

    @staticmethod
    def _kv_short(c: Candidate, q: PlacementQuery) -> bool:
        """Whether the request's blocks would not fit the free pool now."""
        bs = max(c.block_size, 1)
        need = math.ceil((q.num_tokens + q.expected_output) / bs) - c.prefix_hit // bs
        return need > c.free_blocks

    @classmethod
    def backlog(cls, c: Candidate, q: PlacementQuery) -> float:
        """Seconds of work on `c` with the request added: the balance score."""
        batch = min(max(q.reference_batch, 1.0), float(max(c.max_num_seqs, 1)))
        per_output = c.overhead / batch + c.per_token
        uncached = max(q.num_tokens - c.prefix_hit, 1)
        seconds = cls.prefill_seconds(c, c.uncomputed_tokens + uncached)
        seconds += per_output * (c.decode_tokens + q.expected_output)
        if cls._kv_short(c, q):
            seconds += per_output * q.expected_output
        return seconds

    @classmethod
    def latency(cls, c: Candidate, q: PlacementQuery) -> float:
        """The request's own expected seconds to finish on `c`: prefill queued ahead of it,
        its uncached prefill, its decode at the batch it joins (in rounds of max_num_seqs)."""
        count = c.num_requests + 1
        seqs = max(c.max_num_seqs, 1)
        step = c.overhead + c.per_token * min(count, seqs)
        seconds = cls.prefill_seconds(c, c.uncomputed_tokens)
        seconds += cls.prefill_seconds(c, max(q.num_tokens - c.prefix_hit, 1))
        seconds += q.expected_output * step * math.ceil(count / seqs)
        if cls._kv_short(c, q):
            seconds += q.expected_output * step
        return seconds

    def choose(self, q: PlacementQuery, candidates: list[Candidate]) -> PlacementDecision | None:
        """The executor for this request, or None when there is no candidate."""
        if not candidates:
            return None
        best = min(candidates, key=lambda c: (self.backlog(c, q), c.placed, c.key))
        best_latency = self.latency(best, q)
        top = max(c.prefix_hit for c in candidates)
        if top > 0 and best.prefix_hit == top:
            return PlacementDecision(best.key, "affinity", top, best_latency, best_latency)
        if self.prefix_affinity and top > 0:
            holders = [(self.latency(c, q), c) for c in candidates if c.prefix_hit == top]
            aff_latency, aff = min(holders, key=lambda h: (h[0], h[1].key))
            if aff_latency - best_latency <= self.affinity_max_wait:
                return PlacementDecision(aff.key, "affinity", top, aff_latency, best_latency)
        return PlacementDecision(best.key, "load", best.prefix_hit, best_latency, best_latency)


def candidate_of(snap: ExecutorSnapshot, prefix_hit: int) -> Candidate:
    """An executor, from its snapshot, as a candidate for a request of which `prefix_hit`
    tokens are cached (or queued) there."""
    return Candidate(
        key=snap.address,
        prefix_hit=prefix_hit,
        num_requests=snap.requests,
        uncomputed_tokens=snap.uncomputed_tokens,
        decode_tokens=snap.decode_tokens,
        max_num_seqs=snap.max_num_seqs,
        max_num_batched_tokens=snap.max_num_batched_tokens,
        free_blocks=snap.free_blocks,
        block_size=snap.block_size,
        overhead=snap.overhead,
        per_token=snap.per_token,
        placed=snap.requests_placed,
    )


def mean_step_cost(snapshots: Iterable[ExecutorSnapshot]) -> tuple[float, float] | None:
    """(overhead, per_token) averaged over the executors whose step cost has been measured;
    None when none has (a new executor's prior: the fleet's average)."""
    fitted = [(s.overhead, s.per_token) for s in snapshots if s.measured_steps > 0]
    if not fitted:
        return None
    return (sum(f[0] for f in fitted) / len(fitted), sum(f[1] for f in fitted) / len(fitted))
