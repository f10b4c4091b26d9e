"""This controller's side of executor ownership: its owner id, and how to read an executor's
refusal to grant its session.

An executor grants its session to one controller at a time, under a lease the controller
renews (common.host.lease on the executor's side). A refused InitDevice (the client raises
``OwnedElsewhere``) is not a failure of the executor: the session waits and retries when the
other owner's lease would expire. A session whose lease was lost (``LeaseLost``) is lost like
any other: its requests move, and it reconnects.
"""

from __future__ import annotations

import socket
import uuid
from typing import TYPE_CHECKING

import grpc

from common.wire.ownership import OWNER_TRAILER, SECONDS_LEFT_TRAILER

if TYPE_CHECKING:
    from controller.settings import ControllerConfig


def new_owner_id() -> str:
    """A new id for this controller process: its host name (for the logs) and a random part."""
    return f"{socket.gethostname()}/{uuid.uuid4().hex[:12]}"


def refusal(exc: grpc.aio.AioRpcError) -> tuple[str, float] | None:
    """(owner, seconds its lease has left) when an InitDevice error is a refusal because another
    controller owns the executor; None for any other error."""
    if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
        return None
    trailers = dict(exc.trailing_metadata() or ())
    owner = trailers.get(OWNER_TRAILER)
    if owner is None:
        return None
    try:
        left = float(trailers.get(SECONDS_LEFT_TRAILER, "0"))
    except ValueError:
        left = 0.0
    return str(owner), left


def retry_delay(seconds_left: float, cfg: ControllerConfig) -> float:
    """Seconds before asking a refusing executor again: when the other owner's lease would
    expire (it renews while it lives), but at least every third of this controller's own lease
    (its renewal period) and at the reconnect pace, so that an executor the other owner
    released (a graceful shutdown) is taken within that, not a whole lease later."""
    longest = min(cfg.reconnect_backoff_max, cfg.executor_lease_seconds / 3)
    return min(max(seconds_left + 0.1, cfg.reconnect_backoff_min), longest)
