"""Admission control: how much work the controller accepts, and the lifetime of each response.

A response is admitted with a `Ticket` before any of its sequences reaches the engine. A
sequence counts as *queued* from admission until its first output (or its end): queued
sequences and their prompt tokens are bounded per fleet, and a request that does not fit is
refused with 429 and a Retry-After hint instead of waiting in an unbounded queue. While the
controller drains for shutdown nothing is admitted (503), and `abort_all` ends every open
response with finish_reason "abort".
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

ABORT = object()  # put into a ticket's queue when the response must end now


@dataclass
class AdmissionLimits:
    """Bounds on the work waiting for its first token, across the fleet."""

    max_queued_requests: int = 1024  # queued sequences (n > 1 counts n); 0 = no bound
    max_queued_tokens: int = 1 << 20  # prompt tokens of queued sequences; 0 = no bound
    retry_after: int = 1  # seconds a refused client is told to wait (Retry-After)


class AdmissionRejected(Exception):
    """A request was not admitted: the queue is full (429), the request alone is larger than
    the bounds (400), or the controller is shutting down (503)."""

    def __init__(self, message: str, status: int, code: str, retry_after: int | None = None):
        super().__init__(message)
        self.message = message  # human-readable reason
        self.status = status  # HTTP status
        self.code = code  # machine-readable code
        self.retry_after = retry_after  # seconds to wait before retrying, when it makes sense


class Ticket:
    """One admitted response: its queued share, and the channel that aborts it."""

    def __init__(self, owner: Admission, tokens: list[int]):
        self._owner = owner
        self._queued = dict(enumerate(tokens))  # sequence index -> prompt tokens, until started
        self._queue: asyncio.Queue | None = None  # the response's output queue, once running
        self.aborted = False  # set by abort_all
        self.closed = False  # released for good

    def attach(self, queue: asyncio.Queue) -> None:
        """The response runs and reads `queue`: an abort arrives there as ABORT."""
        self._queue = queue
        if self.aborted:
            queue.put_nowait((None, ABORT))

    def started(self, index: int) -> None:
        """Sequence `index` produced output (or ended): it no longer counts as queued."""
        tokens = self._queued.pop(index, None)
        if tokens is not None:
            self._owner._release(1, tokens)

    def abort(self) -> None:
        """End the response now (shutdown)."""
        if not self.aborted and not self.closed:
            self.aborted = True
            if self._queue is not None:
                self._queue.put_nowait((None, ABORT))

    def close(self) -> None:
        """The response is over: release whatever it still holds (idempotent)."""
        if self.closed:
            return
        self.closed = True
        for index in list(self._queued):
            self.started(index)
        self._owner._tickets.discard(self)


class Admission:
    """Admits responses within the queue bounds; tracks the open ones for shutdown."""

    def __init__(self, limits: AdmissionLimits):
        self.limits = limits  # the bounds
        self.queued_requests = 0  # sequences admitted that have no output yet
        self.queued_tokens = 0  # their prompt tokens
        self.draining = False  # shutting down: admit nothing
        self.rejected = 0  # requests refused because the queue was full
        self._tickets: set[Ticket] = set()  # open responses

    @property
    def active(self) -> int:
        """Responses admitted and not yet over."""
        return len(self._tickets)

    def admit(self, prompt_tokens: list[int]) -> Ticket:
        """Admit a response of sequences with these prompt lengths, or raise
        AdmissionRejected."""
        lim = self.limits
        if self.draining:
            raise AdmissionRejected(
                "The server is shutting down; retry on another replica.",
                503,
                "shutting_down",
                lim.retry_after,
            )
        count, tokens = len(prompt_tokens), sum(prompt_tokens)
        if lim.max_queued_requests and count > lim.max_queued_requests:
            raise AdmissionRejected(
                f"The request holds {count} sequences (prompts x n); at most "
                f"{lim.max_queued_requests} may be queued.",
                400,
                "too_many_sequences",
            )
        over_requests = (
            lim.max_queued_requests and self.queued_requests + count > lim.max_queued_requests
        )
        # A request alone larger than the token bound still runs when nothing else queues.
        over_tokens = (
            lim.max_queued_tokens
            and self.queued_tokens > 0
            and self.queued_tokens + tokens > lim.max_queued_tokens
        )
        if over_requests or over_tokens:
            self.rejected += 1
            raise AdmissionRejected(
                f"The server is overloaded: {self.queued_requests} requests with "
                f"{self.queued_tokens} prompt tokens wait for their first token. "
                "Retry later.",
                429,
                "queue_full",
                lim.retry_after,
            )
        self.queued_requests += count
        self.queued_tokens += tokens
        ticket = Ticket(self, prompt_tokens)
        self._tickets.add(ticket)
        return ticket

    def _release(self, requests: int, tokens: int) -> None:
        self.queued_requests -= requests
        self.queued_tokens -= tokens

    def start_draining(self) -> None:
        """Admit nothing from now on."""
        self.draining = True

    def abort_all(self) -> int:
        """End every open response with finish_reason "abort"; how many there were."""
        tickets = list(self._tickets)
        for ticket in tickets:
            ticket.abort()
        return len(tickets)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no response is open; False if some still are after `timeout`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._tickets:
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True
