"""The persistent batch: per-request state kept between steps, and each step's input tensors.

The controller sends each step as a diff (``StepInput``). ``InputBatch.prepare`` applies it
through the executor's ``RequestTable`` (common.host.request_table: finished ids dropped first,
new requests taken, cached requests advanced; every request checked against the executor's own
state and limits, a bad one rejected alone), and builds the flat ragged batch of the step on
the host with numpy, moving it to the device in one copy.

A request samples only when the step computes up to its last known token
(``num_computed + num_scheduled == len(tokens)``); the executor appends the sampled token to the
request's state itself (``append_token``), since the controller does not send it back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from common.host.request_table import RequestState, RequestTable
from common.host.step_check import StepLimits
from common.torch.attention import AttentionMetadata
from common.torch.transfer import to_device
from common.wire.step_types import StepInput

__all__ = ["InputBatch", "RequestState", "ScheduledRow", "StepBatch"]


@dataclass
class ScheduledRow:
    """One request's part of a built step (rows are in batch order)."""

    state: RequestState  # the request
    num_computed: int  # tokens already in the cache before this step
    num_scheduled: int  # tokens computed in this step
    samples: bool  # the step reaches its last known token: sample the next one
    num_prompt_logprobs: int  # prompt positions whose logprobs this step returns
    # Index in the state's token_ids of the placeholder its sampled token replaces, where the
    # runner left one at launch (None: the token is appended when the step finishes).
    placeholder: int | None = None


@dataclass
class StepBatch:
    """Inputs of one forward pass, on the device, with host bookkeeping."""

    rows: list[ScheduledRow]  # batch order: single-token requests first
    input_ids: torch.Tensor  # [T] int64 token ids to compute
    positions: torch.Tensor  # [T] int64 their positions
    token_rows: torch.Tensor  # [T] int64 the row each token belongs to
    attn: AttentionMetadata  # paged-attention metadata
    sample_rows: list[int]  # indices into rows that sample, in order
    sample_index: torch.Tensor  # [S] int64 the same indices, on the device
    logits_indices: torch.Tensor  # [S] int64 token index of each sampling row's last token
    prompt_lp_rows: list[int]  # indices into rows returning prompt logprobs, in order
    prompt_lp_indices: torch.Tensor  # [P] int64 token indices of those prompt positions
    prompt_lp_targets: torch.Tensor  # [P] int64 the prompt token following each position
    errors: dict[str, str] = field(default_factory=dict)  # request id -> validation error
    # Some input id is a placeholder for a token the step in flight samples (a negative id,
    # -1 - its index among that step's samples; common.torch.runner): the runner fills it in
    # on the device before the forward pass.
    has_placeholders: bool = False

    @property
    def num_tokens(self) -> int:
        """T: tokens in the forward pass."""
        return int(self.input_ids.shape[0])


class InputBatch:
    """Per-request state of one executor session and the builder of step inputs."""

    def __init__(
        self, block_size: int, vocab_size: int, max_model_len: int, device: torch.device | str
    ):
        self.block_size = block_size  # tokens per KV block
        self.device = torch.device(device)  # where step tensors go
        # Live requests and the limits steps are checked against (the runner sets the limits
        # from its handshake answers; until then, the model's).
        self.table = RequestTable(
            StepLimits(block_size=block_size, vocab_size=vocab_size, max_model_len=max_model_len)
        )

    @property
    def requests(self) -> dict[str, RequestState]:
        """Live requests by id."""
        return self.table.requests

    def set_limits(self, limits: StepLimits) -> None:
        """Check steps against these limits from now on."""
        self.table.limits = limits

    def __len__(self) -> int:
        return len(self.table)

    def clear(self) -> None:
        """Forget every request."""
        self.table.clear()

    def remove(self, request_id: str) -> None:
        """Forget one request after a failure (no error if unknown)."""
        self.table.drop(request_id)

    def append_token(self, request_id: str, token_id: int) -> None:
        """Record a token sampled for the request."""
        self.table.requests[request_id].token_ids.append(token_id)

    # --- building the step --------------------------------------------------------------

    def schedule(self, step: StepInput) -> tuple[list[ScheduledRow], dict[str, str]]:
        """Apply the step's diff; return the rows to compute (single-token requests first) and
        the errors of requests failing checks (left out, their state dropped)."""
        runnable, errors = self.table.apply(step)
        # Single-token requests first: attention batches them in one pass.
        runnable.sort(key=lambda r: r[2] != 1)
        rows = []
        for state, computed, scheduled in runnable:
            end = computed + scheduled
            lp_end = min(end, state.num_prompt_tokens - 1)
            num_lp = max(0, lp_end - computed) if state.sampling.prompt_logprobs is not None else 0
            rows.append(
                ScheduledRow(state, computed, scheduled, end == len(state.token_ids), num_lp)
            )
        return rows, errors

    def prepare(self, step: StepInput) -> StepBatch:
        """Apply the step's diff and build its device inputs (see ``schedule``)."""
        rows, errors = self.schedule(step)
        batch = self.build(rows)
        batch.errors = errors
        return batch

    def build(self, rows: list[ScheduledRow]) -> StepBatch:
        """Tensors of a step over ``rows`` (already validated and ordered)."""
        bs = self.block_size
        num_reqs = len(rows)
        computed = np.fromiter((r.num_computed for r in rows), np.int64, num_reqs)
        scheduled = np.fromiter((r.num_scheduled for r in rows), np.int64, num_reqs)
        seq_lens = computed + scheduled
        qsl = np.zeros(num_reqs + 1, np.int64)
        np.cumsum(scheduled, out=qsl[1:])
        num_tokens = int(qsl[-1])
        req_of_token = np.repeat(np.arange(num_reqs), scheduled)
        positions = (
            np.arange(num_tokens, dtype=np.int64) - qsl[req_of_token] + computed[req_of_token]
        )
        input_ids = np.empty(num_tokens, np.int64)
        max_blocks = int(max((-(-int(s) // bs) for s in seq_lens), default=1)) or 1
        tables = np.zeros((num_reqs, max_blocks), np.int64)
        for i, r in enumerate(rows):
            c, n = r.num_computed, r.num_scheduled
            input_ids[qsl[i] : qsl[i + 1]] = r.state.token_ids[c : c + n]
            nb = -(-(c + n) // bs)
            tables[i, :nb] = r.state.block_ids[:nb]
        slots = tables[req_of_token, positions // bs] * bs + positions % bs
        sample_rows = [i for i, r in enumerate(rows) if r.samples]
        logits_idx = qsl[1:][sample_rows] - 1 if sample_rows else np.zeros(0, np.int64)
        lp_rows = [i for i, r in enumerate(rows) if r.num_prompt_logprobs > 0]
        lp_idx, lp_tgt = [], []
        for i in lp_rows:
            r = rows[i]
            lp_idx.append(np.arange(r.num_prompt_logprobs, dtype=np.int64) + qsl[i])
            start = r.num_computed + 1
            lp_tgt.append(
                np.asarray(r.state.token_ids[start : start + r.num_prompt_logprobs], np.int64)
            )
        parts = [
            input_ids,
            positions,
            req_of_token.astype(np.int64),
            slots,
            qsl,
            seq_lens,
            tables.reshape(-1),
            np.asarray(logits_idx, np.int64),
            np.asarray(sample_rows, np.int64),
        ]
        parts += [
            np.concatenate(lp_idx) if lp_idx else np.zeros(0, np.int64),
            np.concatenate(lp_tgt) if lp_tgt else np.zeros(0, np.int64),
        ]
        # The one host->device copy (queued behind the device's work, not waiting for it).
        dev = to_device(np.concatenate(parts), torch.int64, self.device)
        ids_t, pos_t, rows_t, slot_t, qsl_t, sl_t, tab_t, li_t, si_t, lpi_t, lpt_t = dev.split(
            [len(p) for p in parts]
        )
        num_decodes = 0  # the leading run of single-token rows
        while num_decodes < num_reqs and rows[num_decodes].num_scheduled == 1:
            num_decodes += 1
        attn = AttentionMetadata(
            slot_mapping=slot_t,
            query_start_loc=qsl_t,
            seq_lens=sl_t,
            block_tables=tab_t.view(num_reqs, max_blocks),
            block_size=bs,
            num_decodes=num_decodes,
            max_decode_seq_len=int(seq_lens[:num_decodes].max()) if num_decodes else 0,
            query_start_loc_host=qsl.tolist(),
            seq_lens_host=seq_lens.tolist(),
        )
        return StepBatch(
            rows=rows,
            input_ids=ids_t,
            positions=pos_t,
            token_rows=rows_t,
            attn=attn,
            sample_rows=sample_rows,
            sample_index=si_t,
            logits_indices=li_t,
            prompt_lp_rows=lp_rows,
            prompt_lp_indices=lpi_t,
            prompt_lp_targets=lpt_t,
            has_placeholders=bool(num_tokens) and int(input_ids.min()) < 0,
        )
