"""Sampling with static shapes: every tensor is [R, ...] for the step's request bucket R.

The parameters and order of operations are those of common.torch.sampling (the GPU executor's):
logprobs from the raw logits; repetition, frequency and presence penalties; stop ids masked
before ``min_tokens``; greedy rows take the argmax; random rows divide by the temperature, keep
top-k, then the top-p nucleus of the top-k distribution, then drop tokens below min-p times the
best, and draw by the exponential race ``argmax(probs / E)``.

What makes it static:

- a step picks one of a few compiled variants on the host (``SampleVariant``): ``greedy``
  (argmax only, no logprobs), ``topk`` (candidates from a top-``CANDIDATES`` selection; rows
  without top-k or top-p race over the whole vocabulary) or ``sort`` (a full sort, for rows with
  top-p but no top-k, or a top-k above ``CANDIDATES``); each with or without ``adjust``
  (penalties and min-tokens masking, whose inputs are only sent when a row needs them), and
  each with or without ``masked`` (structured output: a row's allowed-token mask, see
  executor_tpu.token_mask, sets disallowed logits to -inf before logprobs and sampling);
- penalties read a fixed-width token history [R, max_model_len] (padded with the vocabulary
  size, scattered into [R, V] counts); the stop ids to mask are a dense [R, V] mask;
- the exponential noise is a counter-based hash of (row key, token id) computed on the device:
  no generator state and no data-dependent shape. A seeded row's key mixes (seed, position), so
  its sample depends only on the seed, the position and the distribution (a request recomputed
  after preemption draws the same tokens); unseeded rows take keys from a per-executor counter.
  The noise differs from the GPU executor's generator, so seeded samples agree within an
  executor kind, not across kinds.

Masks are separate variants, not applied to every step: measured on XLA:CPU (the default model,
step budget 64, request bucket 8), the six masked variants add ~10 s to a 46 s warm-up (~1.6 s
of compilation each, per request bucket); applying an all-ones mask to every unconstrained step
instead costs its ``greedy`` sampling program x1.5..x4.4 (+0.7..+30 ms) and its ``topk`` one
0..+35 % at vocabularies of 49k and 152k and request buckets of 8 and 64. Unconstrained steps
pay nothing this way; a step with at least one masked row runs the masked program, its other
rows' words all ones. Logprobs of a masked row are of the constrained distribution (the raw
logits with the mask applied, before penalties and temperature, as vLLM's structured output
reports them): a disallowed token is never among the top logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from common.torch.sampling import seed_key
from common.torch.token_mask import keep_some_token
from common.wire.step_types import SamplingParams, TokenLogprobs
from executor_tpu.token_mask import apply_mask, mask_words

#: Candidates of the ``topk`` variant.
CANDIDATES = 256

_GOLDEN = 0x9E3779B97F4A7C15 - 2**64  # odd 64-bit constants as signed int64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


@dataclass(frozen=True)
class SampleVariant:
    """Which compiled sampling program a step uses."""

    kind: str  # "greedy", "topk" or "sort"
    adjust: bool  # penalties / min-tokens masking present
    masked: bool = False  # a row has an allowed-token mask (structured output)


#: Every variant, in warm-up order.
VARIANTS = [
    SampleVariant(kind, adjust, masked)
    for masked in (False, True)
    for kind in ("greedy", "topk", "sort")
    for adjust in (False, True)
]


def choose_variant(
    params: list[SamplingParams], vocab_size: int, num_outputs: list[int], masked: bool = False
) -> SampleVariant:
    """The cheapest variant that samples ``params`` exactly (``masked``: some row has an
    allowed-token mask)."""
    adjust = any(
        p.has_penalties or (n < p.min_tokens and p.stop_token_ids)
        for p, n in zip(params, num_outputs)
    )
    random = [p for p in params if not p.greedy]
    if not random and all(p.logprobs is None for p in params):
        return SampleVariant("greedy", adjust, masked)
    for p in random:
        k = p.top_k if 0 < p.top_k < vocab_size else 0
        if k > CANDIDATES or (k == 0 and p.top_p < 1.0):
            return SampleVariant("sort", adjust, masked)
    return SampleVariant("topk", adjust, masked)


@dataclass
class SamplingInputs:
    """A step's sampling parameters on the host, one row per request-bucket row."""

    variant: SampleVariant  # the compiled program to run
    floats: np.ndarray  # [6, R] float32: temperature, top_p, min_p, presence, frequency,
    # repetition
    ints: np.ndarray  # [2, R] int64: top_k (0 = off), noise key
    history: np.ndarray | None  # [R, max_model_len] int64 tokens (pad = vocab), adjust only
    output_start: np.ndarray | None  # [R] int64 index of the first generated token in history
    suppress: np.ndarray | None  # [R, V] bool stop ids masked before min_tokens, adjust only
    num_logprobs: list[int | None]  # per real row: top logprobs asked for (None = none)
    allowed: np.ndarray | None = None  # [R, words] int32 packed allowed tokens, masked only

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays to move to the device, by name."""
        out = {"s_floats": self.floats, "s_ints": self.ints}
        if self.variant.adjust:
            out.update(
                s_history=self.history, s_output_start=self.output_start, s_suppress=self.suppress
            )
        if self.variant.masked:
            out["s_allowed"] = self.allowed
        return out


def build_sampling_inputs(
    params: list[SamplingParams],
    token_ids: list[list[int]],
    num_prompt: list[int],
    request_bucket: int,
    vocab_size: int,
    history_width: int,
    max_logprobs: int,
    unseeded_keys: list[int],
    variant: SampleVariant | None = None,
    masks: list[bytes | None] | None = None,
) -> SamplingInputs:
    """Host arrays for the rows' parameters; row i samples the token at ``len(token_ids[i])``.
    ``unseeded_keys`` gives the noise key of each row without a seed (one per row);
    ``masks`` each row's allowed-token mask (None = any token; see executor_tpu.token_mask)."""
    n = len(params)
    masks = masks or [None] * n
    outputs = [len(t) - p for t, p in zip(token_ids, num_prompt)]
    masked = any(m is not None for m in masks)
    variant = variant or choose_variant(params, vocab_size, outputs, masked)
    floats = np.zeros((6, request_bucket), np.float32)
    floats[1], floats[5] = 1.0, 1.0  # top_p and repetition off for padding rows
    ints = np.zeros((2, request_bucket), np.int64)
    for i, p in enumerate(params):
        floats[:, i] = (
            0.0 if p.greedy else p.temperature,  # a temperature near 0 is greedy (see greedy)
            min(max(p.top_p, 0.0), 1.0),
            p.min_p,
            p.presence_penalty,
            p.frequency_penalty,
            p.repetition_penalty,
        )
        ints[0, i] = p.top_k if 0 < p.top_k < vocab_size else 0
        ints[1, i] = seed_key(p.seed, len(token_ids[i])) if p.seed is not None else unseeded_keys[i]
    history = output_start = suppress = None
    if variant.adjust:
        history = np.full((request_bucket, history_width), vocab_size, np.int64)
        output_start = np.zeros(request_bucket, np.int64)
        suppress = np.zeros((request_bucket, vocab_size), np.bool_)
        for i, p in enumerate(params):
            if p.has_penalties:
                ids = token_ids[i][:history_width]
                history[i, : len(ids)] = ids
                output_start[i] = num_prompt[i]
            if outputs[i] < p.min_tokens:
                stops = [t for t in p.stop_token_ids if 0 <= t < vocab_size]
                suppress[i, stops] = True
    num_lp = [None if p.logprobs is None else min(p.logprobs, max_logprobs) for p in params]
    allowed = mask_words(masks, request_bucket, vocab_size) if variant.masked else None
    return SamplingInputs(
        variant, floats, ints, history, output_start, suppress, num_lp[:n], allowed
    )


# --- device side ------------------------------------------------------------------------------


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def hash_uniform(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Uniform [0, 1) float32 noise of (row key [R], token ids [R, K]): a 64-bit mix."""
    x = keys[:, None] + token_ids * _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    x = x ^ _shift_right(x, 31)
    return _shift_right(x, 40).float() * (2.0**-24)


def _race(logits: torch.Tensor, token_ids: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Index (into the last axis) drawn from softmax(logits) by the exponential race. Tokens of
    probability 0 (masked, filtered) score -1: a noise draw of exactly 0 (E = inf) scores an
    allowed token 0 and must not tie with them."""
    probs = logits.softmax(dim=-1)
    scores = probs / -torch.log(hash_uniform(keys, token_ids))
    return torch.where(probs > 0, scores, -1.0).argmax(dim=-1)


def adjust_logits(
    logits: torch.Tensor, d: dict[str, torch.Tensor], masked: bool = False
) -> torch.Tensor:
    """Penalties over the token history, then the min-tokens mask; with ``masked`` (allowed-
    token masks applied before) a row the min-tokens mask would leave without any token keeps
    its stop ids (the grammar allows only a stop: it wins, as on the GPU executor)."""
    rows, vocab = logits.shape
    presence, frequency, repetition = d["s_floats"][3:6]
    history = d["s_history"]  # [R, L], vocab = padding
    column = torch.arange(history.shape[1], device=logits.device)
    generated = (column[None, :] >= d["s_output_start"][:, None]) & (history < vocab)
    seen = torch.zeros(rows, vocab + 1, device=logits.device).scatter(1, history, 1.0)
    seen = seen[:, :vocab] > 0
    counts = torch.zeros(rows, vocab + 1, device=logits.device).scatter_add(
        1, torch.where(generated, history, vocab), torch.ones_like(history, dtype=torch.float32)
    )
    counts = counts[:, :vocab]
    rep = repetition[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).float()
    suppressed = logits.masked_fill(d["s_suppress"], float("-inf"))
    return keep_some_token(suppressed, logits) if masked else suppressed


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> torch.Tensor:
    """[N, 2 + 2k] float32: logprob and rank of ``token_ids`` under ``logits``, then the top-k
    token ids and their logprobs."""
    lp = logits.float().log_softmax(dim=-1)
    chosen = lp.gather(1, token_ids[:, None])
    rank = (lp > chosen).sum(dim=-1, keepdim=True).float() + 1
    parts = [chosen, rank]
    if k > 0:
        top_lp, top_ids = lp.topk(k, dim=-1)
        parts += [top_ids.float(), top_lp]
    return torch.cat(parts, dim=1)


def truncate(
    x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, kind: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates of each row of temperature-scaled logits ``x`` [R, V] after top-k, top-p
    and min-p: (logits [R, K], token ids [R, K]), best first, dropped ones at -inf. ``kind``
    "sort" keeps every token as a candidate; "topk" the best ``CANDIDATES`` (enough for rows
    with top_k <= CANDIDATES; rows without top-k or top-p need the full vocabulary)."""
    vocab = x.shape[1]
    if kind == "sort":
        vals, ids = x.sort(dim=-1, descending=True)
    else:
        vals, ids = x.topk(min(CANDIDATES, vocab), dim=-1)
    ranks = torch.arange(vals.shape[1], device=x.device)[None, :]
    vals = vals.masked_fill(ranks >= torch.where(top_k > 0, top_k, vocab)[:, None], float("-inf"))
    # Top-p over the top-k distribution (or the whole vocabulary for rows without top-k).
    norm = torch.where(top_k > 0, vals.logsumexp(dim=-1), x.logsumexp(dim=-1))
    probs = (vals - norm[:, None]).exp()
    drop = ((probs.cumsum(dim=-1) - probs) > top_p[:, None]) & (top_p[:, None] < 1.0) & (ranks > 0)
    vals = vals.masked_fill(drop, float("-inf"))
    vals = vals.masked_fill(vals < vals[:, :1] + torch.log(min_p)[:, None], float("-inf"))
    return vals, ids


def sample(
    logits: torch.Tensor,
    row_ok: torch.Tensor,
    d: dict[str, torch.Tensor],
    variant: SampleVariant,
    num_logprobs: int,
) -> torch.Tensor:
    """Sample a row of ``logits`` [R, V]; returns [R, 2] (token, row ok) for ``greedy``, else
    [R, 4 + 2 * num_logprobs] (token, row ok, then ``token_logprobs``). Token ids travel as
    float32, exact below 2**24. A ``masked`` variant first sets disallowed tokens to -inf:
    sampling and logprobs are of the constrained distribution."""
    if variant.masked:
        logits, row_ok = apply_mask(logits, row_ok, d["s_allowed"])
    raw = logits
    if variant.adjust:
        logits = adjust_logits(logits, d, variant.masked)
    greedy = logits.argmax(dim=-1)
    if variant.kind == "greedy":
        return torch.stack([greedy.float(), row_ok.float()], dim=1)
    temperature, top_p, min_p = d["s_floats"][0:3]
    top_k, keys = d["s_ints"][0], d["s_ints"][1]
    vocab = logits.shape[1]
    is_random = temperature > 0
    x = logits / torch.where(is_random, temperature, 1.0)[:, None]
    vals, ids = truncate(x, top_k, top_p, min_p, variant.kind)
    token = ids.gather(1, _race(vals, ids, keys)[:, None])[:, 0]
    if variant.kind == "topk":  # rows without top-k / top-p race over every token
        floor = x.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]
        full = x.masked_fill(x < floor, float("-inf"))
        every = torch.arange(vocab, device=x.device)[None, :].expand(x.shape[0], vocab)
        truncated = (top_k > 0) | (top_p < 1.0)
        token = torch.where(truncated, token, _race(full, every, keys))
    token = torch.where(is_random, token, greedy)
    return torch.cat(
        [token.float()[:, None], row_ok.float()[:, None], token_logprobs(raw, token, num_logprobs)],
        dim=1,
    )


def unpack_logprobs(row: np.ndarray, token: int, k: int) -> TokenLogprobs:
    """TokenLogprobs from a ``token_logprobs`` row, trimmed to k alternatives."""
    width = (len(row) - 2) // 2
    top_lps = row[2 + width : 2 + width + k]
    # A masked row allowing fewer than k tokens has disallowed ones (at -inf) among its top k.
    keep = np.isfinite(top_lps)
    return TokenLogprobs(
        token_id=token,
        logprob=float(row[0]),
        rank=int(row[1]),
        top_token_ids=row[2 : 2 + k][keep].astype(np.int64).tolist(),
        top_logprobs=top_lps[keep].tolist(),
    )
