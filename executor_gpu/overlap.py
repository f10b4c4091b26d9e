"""A step in two halves, so that the host builds step N+1 while the device runs step N.

``GPUModelRunner.launch_rows`` queues a step's device work and returns at once; its results
come back in ``finish_rows``. Between the two the servicer may launch the next step
(common.host.step_pipeline.run_overlapped). Two things make that possible:

- **Placeholders.** A decode of step N+1 computes the token step N samples, which the host does
  not have yet. At launch, each sampling row's request gets a placeholder token appended:
  ``-1 - j``, j being the row's index among the step's samples (token ids are never negative:
  the step checks refuse them). A step built over placeholders fills them in on the device from
  the sampled-token tensor of the step in flight (``fill_placeholders``): in its input ids, and
  in the token histories of its rows with penalties. Finishing step N writes the real tokens
  over its placeholders. Only one step is ever in flight at a launch, so a placeholder always
  refers to the previous launch's samples.
- **Results copied behind an event.** The sampled tokens, the rows' finiteness and the
  logprobs are copied to pinned host memory without waiting, and an event is recorded after
  the copies (``PendingRows``); ``results`` waits for that event alone. Every host-to-device
  copy of a launch goes through pinned memory too (common.torch.transfer), so nothing in a
  launch waits for the step before it.

On the CPU the device work is done when a launch returns, and the two halves are simply run one
after the other (unless the overlap is forced on, for tests).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.torch.input_batch import ScheduledRow, StepBatch
from common.torch.logprobs import LogprobsTensors
from common.torch.runner import RowResults
from common.wire.step_types import TokenLogprobs


def fill_placeholders(token_ids: torch.Tensor, in_flight: torch.Tensor | None) -> torch.Tensor:
    """``token_ids`` (any shape: a step's input ids, penalty rows' histories) with every
    placeholder (``-1 - j``) replaced by ``in_flight[j]``, the tokens the step in flight
    samples (on the device, no host wait)."""
    if in_flight is None:
        raise RuntimeError("a step refers to sampled tokens, but no step that samples is in flight")
    index = (-1 - token_ids).clamp_(min=0)
    return torch.where(token_ids >= 0, token_ids, torch.take(in_flight, index))


def leave_placeholders(rows: list[ScheduledRow], sample_rows: list[int]) -> None:
    """Append a placeholder for each sampling row's next token (see the module's notes)."""
    for j, i in enumerate(sample_rows):
        tokens = rows[i].state.token_ids
        rows[i].placeholder = len(tokens)
        tokens.append(-1 - j)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in host memory, queued without waiting: into pinned memory, which a
    copy from CUDA fills asynchronously (into pageable memory it would wait for the step). A
    CPU tensor is copied too: the next launch may reuse its buffer (the logits scan's
    argmax)."""
    if t.device.type == "cpu":
        return t.clone()
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t, non_blocking=True)


@dataclass
class PendingRows:
    """A launched step's results on their way to the host."""

    batch: StepBatch  # the step's inputs (rows, slots to scrub)
    sampled: torch.Tensor | None  # [S] int64 host copy of the sampled tokens; None: no sample
    row_ok: torch.Tensor  # [R] bool host copy: every value of the row was finite
    logprobs: LogprobsTensors | None  # host copies of the sampled tokens' logprobs
    num_logprobs: list[int | None]  # per sampling row: top logprobs asked for
    event: torch.cuda.Event | None  # recorded after the copies (CUDA); None: they are done
    resets: int  # the runner's reset count at launch (a reset since: no scrubbing)
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)  # by row
    samples: torch.Tensor | None = None  # the device's sampled tokens (placeholders' source)

    @classmethod
    def start(
        cls,
        batch: StepBatch,
        sampled: torch.Tensor | None,
        row_ok: torch.Tensor,
        logprobs: LogprobsTensors | None,
        num_logprobs: list[int | None],
        resets: int,
    ) -> PendingRows:
        """Queue the copies of a step's results to the host and an event after them."""
        host_lp = None
        if logprobs is not None:
            host_lp = LogprobsTensors(
                *(
                    _to_host(getattr(logprobs, f))
                    for f in ("token_ids", "logprobs", "ranks", "top_ids", "top_logprobs")
                )
            )
        event = None
        device = row_ok.device
        host_sampled = _to_host(sampled) if sampled is not None else None
        host_ok = _to_host(row_ok)
        if device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        return cls(batch, host_sampled, host_ok, host_lp, num_logprobs, event, resets)

    def done(self) -> bool:
        """Whether the copies are done (``results`` would not wait)."""
        return self.event is None or self.event.query()

    def results(self) -> RowResults:
        """The rows' host results, once the copies are done (waits for them)."""
        if self.event is not None:
            self.event.synchronize()
        rows = self.batch.rows
        results = RowResults.empty(len(rows))
        if self.sampled is not None:
            token_lps = (
                self.logprobs.to_token_logprobs(self.num_logprobs)
                if self.logprobs is not None
                else [None] * len(self.batch.sample_rows)
            )
            for j, (i, token) in enumerate(zip(self.batch.sample_rows, self.sampled.tolist())):
                results.sampled[i], results.logprobs[i] = token, token_lps[j]
        results.failed = {i for i, ok in enumerate(self.row_ok.tolist()) if not ok}
        for i, lps in self.prompt_logprobs.items():
            results.prompt_logprobs[i] = lps
        return results
