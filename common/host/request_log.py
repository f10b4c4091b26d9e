"""What an executor logs about single requests, whatever its device.

At DEBUG, a request's arrival (or its return, sent whole again after a preemption or a move)
and its end (the controller finished it and its state is dropped); at WARNING, a request that
failed alone (its state is dropped too). Each record carries the ``request_id`` of the API
request the sequence belongs to (common.wire.request_ids) and prints the sequence id, so an
operator can follow one request through an executor's log at ``--log-level DEBUG``.
"""

from __future__ import annotations

import logging

from common.wire.request_ids import request_id_of
from common.wire.step_types import StepInput, StepOutput

log = logging.getLogger(__name__)


def _extra(seq_id: str) -> dict[str, str]:
    return {"request_id": request_id_of(seq_id)}


def log_step_requests(step: StepInput) -> None:
    """DEBUG lines for the requests a step starts (or resumes) and the ones it drops."""
    if not log.isEnabledFor(logging.DEBUG):
        return
    for rid in step.finished_request_ids:
        log.debug("request %s finished (step %d)", rid, step.step_id, extra=_extra(rid))
    for new in step.new_requests:
        log.debug(
            "request %s %s (step %d): %d prompt tokens, %d output tokens, %d cached, "
            "%d scheduled, %d blocks",
            new.request_id,
            "resumes" if new.output_token_ids else "arrives",
            step.step_id,
            len(new.prompt_token_ids),
            len(new.output_token_ids),
            new.num_computed_tokens,
            new.num_scheduled_tokens,
            len(new.block_ids),
            extra=_extra(new.request_id),
        )


def log_failed_requests(output: StepOutput) -> None:
    """A WARNING line per request the step failed alone."""
    for out in output.outputs:
        if out.error:
            log.warning(
                "request %s failed (step %d): %s",
                out.request_id,
                output.step_id,
                out.error,
                extra=_extra(out.request_id),
            )
