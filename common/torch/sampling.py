"""Batched, on-device sampling of one step's next tokens, and logprobs.

All rows of a step are sampled together. Order of operations per row:

1. structured output (only rows with an allowed-token mask; common.torch.token_mask): tokens
   the request's grammar does not allow get logit -inf, on the device, before anything else;
2. logprobs (when asked) come from ``log_softmax`` of these logits: the RAW logits of an
   unconstrained row, the masked ones of a constrained row (the constrained distribution, as
   vLLM's processed logprobs: a disallowed token never appears among the top logprobs, and
   top entries of probability 0 are left out);
3. penalties (only rows that have any): repetition over prompt + generated tokens (positive
   logits divided, negative multiplied), then frequency and presence over generated tokens;
   then min_tokens' suppression of stop ids, which a mask overrides when it would leave a
   constrained row no token at all (the grammar allows only a stop);
4. greedy rows (temperature 0) take the argmax (the caller's, if it has it and 1-3 changed nothing);
5. random rows: divide by temperature, keep the top_k best, then the smallest top_p nucleus
   (of the top-k distribution), then drop tokens whose probability is below min_p times the
   best one; sample by the exponential race ``argmax(probs / E)``, ``E ~ Exp(1)`` per token.
   A masked token has probability 0 and is never drawn (in a step with masks the noise is
   kept finite, so that a 0 can never tie with an allowed token).

Random rows come in two groups: rows with top-k/top-p work on a few candidate tokens (a top-k
instead of a full-vocabulary sort; rows with top-p only take ``TOP_P_CANDIDATES`` and fall back to
the whole vocabulary if those do not hold the nucleus), the other rows on the whole vocabulary.

The noise of a seeded row comes from a generator seeded with a mix of (seed, position) and is
indexed by token id, so the sample is a deterministic function of the seed, the position in the
sequence and the distribution: a request recomputed after preemption samples the same tokens.
Unseeded rows draw from one generator seeded with the executor's seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# The logprob helpers stay importable from here (explicit re-exports), where callers look.
from common.torch.logprobs import LogprobsTensors as LogprobsTensors
from common.torch.logprobs import compute_logprobs as compute_logprobs
from common.torch.logprobs import compute_prompt_logprobs as compute_prompt_logprobs
from common.torch.token_mask import apply_token_masks, keep_some_token, mask_tensors
from common.torch.transfer import to_device
from common.wire.step_types import SamplingParams

#: Candidates kept for rows with top-p but no top-k before checking they hold the nucleus.
TOP_P_CANDIDATES = 256


@dataclass
class RandomGroup:
    """Random rows (temperature > 0) sampled the same way; tensors are indexed by the group."""

    rows: torch.Tensor  # [n] int64 indices of the group's rows among the step's sampling rows
    temperature: torch.Tensor  # [n] float32
    top_k: torch.Tensor | None  # [n] int64, 0 = off; None when no row uses it
    top_p: torch.Tensor | None  # [n] float32, 1 = off; None when no row uses it
    min_p: torch.Tensor | None  # [n] float32, 0 = off; None when no row uses it
    max_top_k: int  # largest top_k in the group (host copy)
    rows_without_k: bool  # some row has top_p but no top_k (candidates need a mass check)
    seeded: list[int]  # group indices of rows with their own seed (host)
    seed_keys: list[int]  # generator seeds of those rows, from (seed, position)

    @property
    def truncated(self) -> bool:
        """Rows keep only candidate tokens (top-k / top-p)."""
        return self.top_k is not None or self.top_p is not None


@dataclass
class SamplingMetadata:
    """Sampling parameters of a step's sampling rows, on the device."""

    num_rows: int  # S: rows of the logits to sample from
    greedy_rows: torch.Tensor | None  # [G] int64 rows taking the argmax; None when none
    random_groups: list[RandomGroup]  # random rows: full-vocabulary and/or truncated group
    penalty_rows: torch.Tensor | None  # [P] int64 rows with penalties; None when none
    presence: torch.Tensor | None  # [P] float32 presence penalties
    frequency: torch.Tensor | None  # [P] float32 frequency penalties
    repetition: torch.Tensor | None  # [P] float32 repetition penalties (1 = off)
    output_tokens: torch.Tensor | None  # [P, Lo] int64 generated tokens, padded with vocab
    seen_tokens: torch.Tensor | None  # [P, Ls] int64 prompt + generated, padded with vocab
    num_logprobs: list[int | None]  # per row: top logprobs asked for; None = no logprobs
    max_num_logprobs: int  # k computed for the batch; -1 = no row asked
    suppress_rows: torch.Tensor | None = None  # [B] rows still short of min_tokens
    suppress_ids: torch.Tensor | None = None  # [B] the stop id masked in that row
    # Structured output: packed allowed-token masks [M, bytes] uint8 of the masked rows (None:
    # no row has one, nothing is built), and those rows [M] int64 (None: every row, in order).
    masks: torch.Tensor | None = None
    mask_rows: torch.Tensor | None = None

    @property
    def needs_logprobs(self) -> bool:
        """Whether any row asked for logprobs."""
        return self.max_num_logprobs >= 0


@dataclass
class SamplerOutput:
    """Result of sampling one step."""

    sampled_token_ids: torch.Tensor  # [S] int64
    logprobs: LogprobsTensors | None  # for the sampled tokens; None when no row asked


def seed_key(seed: int, position: int) -> int:
    """Generator seed of a (request seed, sequence position) pair (a 63-bit mix)."""
    x = (seed & (2**64 - 1)) * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 1
    x &= 2**64 - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 31)) >> 1


# --- metadata -------------------------------------------------------------------------------


def _pad(rows: list[Sequence[int]], pad: int) -> list[list[int]]:
    width = max((len(r) for r in rows), default=0) or 1
    return [list(r) + [pad] * (width - len(r)) for r in rows]


def _random_group(
    rows: list[int],
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    vocab_size: int,
    device: torch.device | str,
) -> RandomGroup:
    ps = [params[i] for i in rows]
    ks = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in ps]
    tops = [min(max(p.top_p, 0.0), 1.0) for p in ps]

    def t(values, dtype):
        return to_device(values, dtype, device)

    seeded = [j for j, p in enumerate(ps) if p.seed is not None]
    return RandomGroup(
        rows=t(rows, torch.int64),
        temperature=t([p.temperature for p in ps], torch.float32),
        top_k=t(ks, torch.int64) if any(ks) else None,
        top_p=t(tops, torch.float32) if any(p < 1.0 for p in tops) else None,
        min_p=t([p.min_p for p in ps], torch.float32) if any(p.min_p > 0 for p in ps) else None,
        max_top_k=max(ks),
        rows_without_k=0 in ks,
        seeded=seeded,
        seed_keys=[seed_key(ps[j].seed, positions[rows[j]]) for j in seeded],
    )


def build_sampling_metadata(
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    vocab_size: int,
    device: torch.device | str,
    max_logprobs: int = 20,
    num_outputs: Sequence[int] | None = None,
    masks: Sequence[bytes | None] | None = None,
) -> SamplingMetadata:
    """Host-side construction of a step's sampling tensors.

    ``positions[i]`` is the sequence index the sampled token of row i will occupy (it keys the
    seeded noise). Token histories are read only for rows with penalties. ``num_outputs[i]``
    (tokens generated so far) decides which rows are still short of their min_tokens.
    ``masks[i]`` is row i's packed allowed-token mask (None or empty: any token).
    """
    rows = range(len(params))
    greedy = [i for i in rows if params[i].greedy]
    truncated = {
        i
        for i in rows
        if not params[i].greedy and (0 < params[i].top_k < vocab_size or params[i].top_p < 1.0)
    }
    full = [i for i in rows if not params[i].greedy and i not in truncated]
    pen = [i for i in rows if params[i].has_penalties]
    num_lp = [None if p.logprobs is None else min(p.logprobs, max_logprobs) for p in params]
    asked = [k for k in num_lp if k is not None]
    meta = SamplingMetadata(
        num_rows=len(params),
        greedy_rows=to_device(greedy, torch.int64, device) if greedy else None,
        random_groups=[
            _random_group(g, params, positions, vocab_size, device)
            for g in (full, sorted(truncated))
            if g
        ],
        penalty_rows=None,
        presence=None,
        frequency=None,
        repetition=None,
        output_tokens=None,
        seen_tokens=None,
        num_logprobs=num_lp,
        max_num_logprobs=max(asked) if asked else -1,
    )
    meta.mask_rows, meta.masks = mask_tensors(masks, device)
    if num_outputs is not None:
        pairs = [
            (i, t)
            for i in rows
            if num_outputs[i] < params[i].min_tokens
            for t in params[i].stop_token_ids
            if 0 <= t < vocab_size
        ]
        if pairs:
            meta.suppress_rows = to_device([r for r, _ in pairs], torch.int64, device)
            meta.suppress_ids = to_device([t for _, t in pairs], torch.int64, device)
    if pen:
        pp = [params[i] for i in pen]

        def t(values, dtype):
            return to_device(values, dtype, device)

        meta.penalty_rows = t(pen, torch.int64)
        meta.presence = t([p.presence_penalty for p in pp], torch.float32)
        meta.frequency = t([p.frequency_penalty for p in pp], torch.float32)
        meta.repetition = t([p.repetition_penalty for p in pp], torch.float32)
        if any(p.presence_penalty or p.frequency_penalty for p in pp):
            meta.output_tokens = t(_pad([output_ids[i] for i in pen], vocab_size), torch.int64)
        if any(p.repetition_penalty != 1.0 for p in pp):
            seen = [list(prompt_ids[i]) + list(output_ids[i]) for i in pen]
            meta.seen_tokens = t(_pad(seen, vocab_size), torch.int64)
    return meta


# --- penalties, filters ----------------------------------------------------------------------


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Penalized logits (a new tensor; rows without penalties are unchanged)."""
    if meta.penalty_rows is None:
        return logits
    vocab = logits.shape[1]
    sub = logits[meta.penalty_rows]
    if meta.seen_tokens is not None:
        seen = torch.zeros(sub.shape[0], vocab + 1, dtype=torch.bool, device=sub.device)
        seen = seen.scatter_(1, meta.seen_tokens, True)[:, :vocab]
        rep = meta.repetition[:, None]
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    if meta.output_tokens is not None:
        counts = torch.zeros(sub.shape[0], vocab + 1, dtype=sub.dtype, device=sub.device)
        ones = torch.ones_like(meta.output_tokens, dtype=sub.dtype)
        counts = counts.scatter_add_(1, meta.output_tokens, ones)[:, :vocab]
        sub = sub - meta.frequency[:, None] * counts - meta.presence[:, None] * (counts > 0)
    return logits.index_copy(0, meta.penalty_rows, sub)


def truncate(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    max_top_k: int,
    rows_without_k: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates of each row after top-k then top-p: (logits [n, K], token ids [n, K]),
    best first, dropped candidates at -inf. top_k 0 / top_p 1 mean off for that row;
    ``rows_without_k`` says some row has no top_k (host flag)."""
    vocab = logits.shape[1]
    k = min(max(max_top_k, TOP_P_CANDIDATES) if rows_without_k else max_top_k, vocab)
    while True:
        vals, ids = logits.topk(k, dim=-1)
        if top_k is not None:
            limit = torch.where(top_k > 0, top_k, vocab)[:, None]
            vals = vals.masked_fill(
                torch.arange(k, device=vals.device)[None, :] >= limit, float("-inf")
            )
        if top_p is None:
            if rows_without_k and k < vocab:
                k = vocab  # a row without any limit keeps every token
                continue
            return vals, ids
        # Normalizer of each row's distribution: its top-k set, or the whole vocabulary.
        norm = _row_logsumexp(logits, vals, ids) if rows_without_k else vals.logsumexp(dim=-1)
        if top_k is not None and rows_without_k:
            norm = torch.where(top_k > 0, vals.logsumexp(dim=-1), norm)
        probs = (vals - norm[:, None]).exp()
        cum = probs.cumsum(dim=-1)
        # A row without top_k needs its whole nucleus among the candidates.
        covered = (cum[:, -1] >= top_p) & (top_p < 1.0)
        if top_k is not None:
            covered |= top_k > 0
        if k < vocab and not bool(covered.all()):
            k = vocab  # the nucleus reaches past the candidates: take every token
            continue
        drop = (cum - probs) > top_p[:, None]
        drop[:, 0] = False
        return vals.masked_fill(drop, float("-inf")), ids


def _row_logsumexp(logits: torch.Tensor, best: torch.Tensor, best_ids: torch.Tensor):
    """Each row's logsumexp over the vocabulary, from its best logit and ``log_softmax`` there
    (``best`` / ``best_ids``: a top-k, best first). torch's CPU ``logsumexp`` runs an ``exp``
    that takes a slow path on -inf entries (structured output's masked tokens: 4x here);
    ``log_softmax`` does not, and is faster on finite rows too."""
    at_best = torch.log_softmax(logits, dim=-1).gather(1, best_ids[:, :1])[:, 0]
    return best[:, 0] - at_best


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's best probability."""
    # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p)
    floor = logits.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]
    return logits.masked_fill(logits < floor, float("-inf"))


def apply_filters(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """Full-width logits with every token outside top-k, top-p and min-p set to -inf."""
    if top_k is not None or top_p is not None:
        max_k = int(top_k.max()) if top_k is not None else 0
        without_k = top_k is None or bool((top_k == 0).any())
        vals, ids = truncate(logits, top_k, top_p, max_k, without_k)
        logits = torch.full_like(logits, float("-inf")).scatter_(1, ids, vals)
    return logits if min_p is None else apply_min_p(logits, min_p)


# --- the sampler ----------------------------------------------------------------------------


class Sampler:
    """Samples a step's tokens in one batched pass on the logits' device."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu"):
        self.generator = torch.Generator(device=device)  # noise of unseeded random rows
        self.generator.manual_seed(seed)
        self.row_generator = torch.Generator(device=device)  # reseeded per seeded row

    def reseed(self, seed: int) -> None:
        """Restart the unseeded-row noise from ``seed``."""
        self.generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, meta: SamplingMetadata, argmax: torch.Tensor | None = None
    ) -> SamplerOutput:
        """Sample one token per row of float32 ``logits`` [S, V]; ``argmax`` [S] is each row's
        argmax where the caller has it already (taken only while nothing changed the logits)."""
        given = logits
        if meta.masks is not None:  # structured output first: the constrained distribution
            logits = apply_token_masks(logits, meta.mask_rows, meta.masks)
        raw = logits
        logits = apply_penalties(logits, meta)
        if meta.suppress_rows is not None:  # no stop token before min_tokens
            kept = logits
            logits = logits.clone() if logits is raw or meta.masks is not None else logits
            logits[meta.suppress_rows, meta.suppress_ids] = float("-inf")
            if meta.masks is not None:  # ... unless the grammar allows nothing else
                logits = keep_some_token(logits, kept)
        argmax = argmax if logits is given else None  # masks, penalties, suppression: stale
        if meta.greedy_rows is not None and not meta.random_groups:
            sampled = argmax if argmax is not None else logits.argmax(dim=-1)
        else:
            sampled = torch.empty(meta.num_rows, dtype=torch.int64, device=logits.device)
            if meta.greedy_rows is not None:
                g = meta.greedy_rows
                sampled[g] = argmax[g] if argmax is not None else logits[g].argmax(dim=-1)
            finite = meta.masks is not None
            for group in meta.random_groups:
                sampled[group.rows] = self._sample_group(logits[group.rows], group, finite)
        lp = compute_logprobs(raw, sampled, meta.max_num_logprobs) if meta.needs_logprobs else None
        return SamplerOutput(sampled_token_ids=sampled, logprobs=lp)

    def _sample_group(
        self, logits: torch.Tensor, group: RandomGroup, finite_noise: bool = False
    ) -> torch.Tensor:
        vocab = logits.shape[1]
        logits = logits / group.temperature[:, None]
        ids = None
        if group.truncated:
            logits, ids = truncate(
                logits, group.top_k, group.top_p, group.max_top_k, group.rows_without_k
            )
        if group.min_p is not None:
            logits = apply_min_p(logits, group.min_p)
        probs = logits.softmax(dim=-1)
        noise = self._exponential(group, ids, probs.shape, vocab)
        if finite_noise:  # E = inf (a draw of exactly 0) would tie with the masked zeros;
            noise = noise.clamp_max(64.0)  # any other draw of torch.rand gives E < 17
        choice = (probs / noise).argmax(dim=-1)
        return choice if ids is None else ids.gather(1, choice[:, None])[:, 0]

    def _exponential(
        self, group: RandomGroup, ids: torch.Tensor | None, shape: torch.Size, vocab: int
    ) -> torch.Tensor:
        """Exp(1) noise for the group's rows: [n, vocab], or at candidate ``ids`` [n, K].

        A seeded row always draws the whole vocabulary from its own generator and picks its
        tokens' entries, so a token's noise does not depend on the candidate set.
        """
        device = self.generator.device
        uniform = (
            torch.rand(shape, generator=self.generator, device=device)
            if len(group.seeded) < shape[0]
            else torch.empty(shape, device=device)
        )
        for j, key in zip(group.seeded, group.seed_keys):
            self.row_generator.manual_seed(key)
            row = torch.rand(vocab, generator=self.row_generator, device=device)
            uniform[j] = row if ids is None else row[ids[j]]
        return -torch.log(uniform)  # uniform in [0, 1): noise in (0, inf]
