"""Static shapes: the step buckets, and a step's inputs padded to them on the host.

An XLA device compiles one program per input shape, so every step is padded to a
(token bucket, request bucket) pair that was compiled during warm-up:

- the step's token count goes up to the smallest token bucket that holds it (powers of two
  from 16 up to the step budget, the budget itself last, unless configured);
- its request count up to the smallest request bucket (powers of two from 8 up to
  ``max_num_seqs``, unless configured);
- every block table has the same width: ``ceil(max_model_len / block_size)`` blocks.

Padding tokens compute token id 0 at position 0 and write their key/value to slot 0 of the
reserved null block 0 (the controller never hands that block out); padding rows have no tokens
and an all-null block table. Everything is built with numpy and moved to the device in one
batch by the runner.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.torch.input_batch import ScheduledRow

#: Smallest default token bucket and request bucket.
MIN_TOKEN_BUCKET = 16
MIN_REQUEST_BUCKET = 8


def power_of_two_buckets(start: int, limit: int) -> list[int]:
    """Powers of two from ``start`` that are below ``limit``, then ``limit`` itself."""
    buckets, size = [], start
    while size < limit:
        buckets.append(size)
        size *= 2
    return buckets + [limit]


def fit_buckets(configured: list[int], limit: int, start: int) -> list[int]:
    """The buckets serving steps of at most ``limit``: the configured ones below the limit plus
    the smallest one reaching it (all of them if none does); powers of two when none is
    configured."""
    if not configured:
        return power_of_two_buckets(min(start, limit), limit)
    sizes = sorted(set(b for b in configured if b > 0))
    if not sizes:
        raise ValueError(f"no positive bucket in {configured}")
    below = [b for b in sizes if b < limit]
    reaching = [b for b in sizes if b >= limit]
    return below + reaching[:1]


def pick_bucket(n: int, buckets: list[int]) -> int:
    """The smallest bucket holding ``n``."""
    for size in buckets:
        if size >= n:
            return size
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclass
class BucketPlan:
    """The shapes an executor compiles and serves."""

    token_buckets: list[int]  # padded token counts of a step, ascending
    request_buckets: list[int]  # padded request counts of a step, ascending
    max_tokens: int  # most real tokens in one step (at most the largest token bucket)
    max_seqs: int  # most real requests in one step (at most the largest request bucket)

    def pairs(self) -> list[tuple[int, int]]:
        """The (token bucket, request bucket) pairs a step can pad to (a step of at most T
        tokens has at most T requests)."""
        return [
            (t, r)
            for t in self.token_buckets
            for r in self.request_buckets
            if r <= pick_bucket(min(t, self.max_seqs), self.request_buckets)
        ]


def plan_buckets(
    max_tokens: int,
    max_seqs: int,
    token_buckets: list[int] | None = None,
    request_buckets: list[int] | None = None,
) -> BucketPlan:
    """Buckets for steps of at most ``max_tokens`` tokens and ``max_seqs`` requests (a step
    never has more requests than tokens)."""
    tokens = fit_buckets(token_buckets or [], max_tokens, MIN_TOKEN_BUCKET)
    max_tokens = min(max_tokens, tokens[-1])
    max_seqs = min(max_seqs, max_tokens)
    reqs = fit_buckets(request_buckets or [], max_seqs, MIN_REQUEST_BUCKET)
    return BucketPlan(tokens, reqs, max_tokens, min(max_seqs, reqs[-1]))


@dataclass
class StaticStep:
    """One step's inputs on the host, padded to a (token bucket, request bucket) pair.

    Rows 0..n-1 are the step's requests in batch order; rows n..R-1 are padding; row R of
    ``block_tables`` is an extra all-null row that padding tokens attend through.
    """

    rows: list[ScheduledRow]  # the real rows, in batch order
    num_tokens: int  # real tokens
    input_ids: np.ndarray  # [T] int64 token ids (0 for padding)
    positions: np.ndarray  # [T] int64 positions (0 for padding)
    slot_mapping: np.ndarray  # [T] int64 cache slot of each token (0 for padding: null block)
    token_rows: np.ndarray  # [T] int64 row of each token (R for padding)
    block_tables: np.ndarray  # [R + 1, W] int32 block ids (0 = null block for padding)
    seq_lens: np.ndarray  # [R] int32 context length after the step (0 for padding rows)
    query_start_loc: np.ndarray  # [R + 1] int32 first token of each row (padding rows empty)
    num_seqs: np.ndarray  # [1] int32 real rows
    logits_indices: np.ndarray  # [R] int64 last token of each row (0 for padding rows)
    prompt_lp_targets: np.ndarray  # [T] int64 next prompt token of prompt-logprob positions

    @property
    def token_bucket(self) -> int:
        """T: padded token count."""
        return int(self.input_ids.shape[0])

    @property
    def request_bucket(self) -> int:
        """R: padded request count."""
        return int(self.seq_lens.shape[0])

    def arrays(self) -> dict[str, np.ndarray]:
        """The arrays to move to the device, by name."""
        return {
            name: getattr(self, name)
            for name in (
                "input_ids",
                "positions",
                "slot_mapping",
                "token_rows",
                "block_tables",
                "seq_lens",
                "query_start_loc",
                "num_seqs",
                "logits_indices",
                "prompt_lp_targets",
            )
        }


def build_static_step(
    rows: list[ScheduledRow],
    token_bucket: int,
    request_bucket: int,
    max_blocks: int,
    block_size: int,
) -> StaticStep:
    """Pad ``rows`` (validated, in batch order) to the given buckets and table width."""
    n = len(rows)
    if n > request_bucket:
        raise ValueError(f"{n} requests exceed the request bucket {request_bucket}")
    computed = np.fromiter((r.num_computed for r in rows), np.int64, n)
    scheduled = np.fromiter((r.num_scheduled for r in rows), np.int64, n)
    num_tokens = int(scheduled.sum())
    if num_tokens > token_bucket:
        raise ValueError(f"{num_tokens} tokens exceed the token bucket {token_bucket}")
    qsl = np.zeros(request_bucket + 1, np.int64)
    np.cumsum(scheduled, out=qsl[1 : n + 1])
    qsl[n + 1 :] = num_tokens
    req_of_token = np.repeat(np.arange(n), scheduled)
    positions = np.zeros(token_bucket, np.int64)
    positions[:num_tokens] = np.arange(num_tokens) - qsl[req_of_token] + computed[req_of_token]
    input_ids = np.zeros(token_bucket, np.int64)
    tables = np.zeros((request_bucket + 1, max_blocks), np.int32)
    targets = np.zeros(token_bucket, np.int64)
    for i, r in enumerate(rows):
        c, s = r.num_computed, r.num_scheduled
        input_ids[qsl[i] : qsl[i + 1]] = r.state.token_ids[c : c + s]
        nb = -(-(c + s) // block_size)
        if nb > max_blocks:
            raise ValueError(
                f"request {r.state.request_id} needs {nb} blocks; the block table "
                f"holds {max_blocks}"
            )
        tables[i, :nb] = r.state.block_ids[:nb]
        if r.num_prompt_logprobs:
            targets[qsl[i] : qsl[i] + r.num_prompt_logprobs] = r.state.token_ids[
                c + 1 : c + 1 + r.num_prompt_logprobs
            ]
    pos = positions[:num_tokens]
    slots = np.zeros(token_bucket, np.int64)
    slots[:num_tokens] = (
        tables[req_of_token, pos // block_size].astype(np.int64) * block_size + pos % block_size
    )
    token_rows = np.full(token_bucket, request_bucket, np.int64)
    token_rows[:num_tokens] = req_of_token
    seq_lens = np.zeros(request_bucket, np.int32)
    seq_lens[:n] = computed + scheduled
    logits_indices = np.zeros(request_bucket, np.int64)
    logits_indices[:n] = qsl[1 : n + 1] - 1
    return StaticStep(
        rows=rows,
        num_tokens=num_tokens,
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slots,
        token_rows=token_rows,
        block_tables=tables,
        seq_lens=seq_lens,
        query_start_loc=qsl.astype(np.int32),
        num_seqs=np.array([n], np.int32),
        logits_indices=logits_indices,
        prompt_lp_targets=targets,
    )
