"""The channel from a response's sequences to its writer, bounded by what the response holds.

The step loops put each sequence's deltas here as they make them (`sink`: the engine's
`submit` takes it as the request's sink, so no task or queue sits between the step and the
response); the response's writer (the SSE generator, or the collector of a non-streamed
response) takes them. A step's deltas for all the sequences of a response wake its writer once.
A writer that lags, because its client reads slowly or not at all, does not let one object per
step pile up: a sequence has at most one pending delta, and later ones merge into it. A stalled
response thus holds its output once, in proportion to what it asked for (tokens, logprobs),
until the stall timeout aborts it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from controller.api.admission import ABORT
from controller.core.outputs import OutputDelta, absorb, own_copy

if TYPE_CHECKING:
    from controller.api.direct_write import DirectWrite


class DeltaQueue:
    """Pending output per sequence, in arrival order, merged while the writer lags.

    Items are ``(index, delta)``, ``(index, exception)`` (the sequence failed) and ``(None,
    ABORT)`` (the ticket's abort: the response must end). Pending items are handed out before
    an abort, as a queue would, so nothing a sequence produced is lost by merging.
    """

    def __init__(self) -> None:
        self._pending: dict[int, list] = {}  # index -> [delta] or [delta, exception]
        self._owned: set[int] = set()  # indexes whose pending delta is a private copy
        # The writer's wake-up while it waits: a bare future, set by the first put of a step
        # (an Event would look the running loop up on every wait).
        self._waiter: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # bound at the first wait
        # The response's direct writer (streaming.py): takes a sequence's delta and writes it
        # to the client at once, or declines (False). Tried only while the writer is idle.
        self.direct: Callable[[int, OutputDelta], bool] | None = None
        self.connection: DirectWrite | None = None  # the client's connection, for `direct`
        self._aborted = asyncio.Event()  # the abort came (shutdown)

    def sink(self, index: int) -> SequenceSink:
        """The engine's sink for the sequence at `index`."""
        return SequenceSink(self, index)

    def put_nowait(self, item: tuple) -> None:
        """Take a sequence's delta or failure, or the response's abort."""
        index, value = item
        if (
            self._waiter is not None  # the writer waits: whatever it took is written
            and self.direct is not None
            and not self._pending
            and type(value) is OutputDelta
            and self.direct(index, value)
        ):
            return
        if value is ABORT:
            self._aborted.set()
        else:
            items = self._pending.get(index)
            if items is None:  # the common case: the writer took the previous step's
                self._pending[index] = [value]
            elif isinstance(last := items[-1], OutputDelta) and isinstance(value, OutputDelta):
                if index not in self._owned:  # the engine's lists stay the engine's
                    items[-1] = last = own_copy(last)
                    self._owned.add(index)
                absorb(last, value)
            else:
                items.append(value)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def get(self) -> tuple:
        """The next item: the oldest sequence's pending output, or the abort once nothing is
        pending."""
        while True:
            if self._pending:
                index = next(iter(self._pending))
                items = self._pending[index]
                value = items.pop(0)
                self._owned.discard(index)  # a merged delta is only ever the first item
                if not items:
                    del self._pending[index]
                return index, value
            if self.aborted:
                return None, ABORT
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
            self._waiter = waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    @property
    def aborted(self) -> bool:
        """Whether the abort came (shutdown)."""
        return self._aborted.is_set()

    async def wait_aborted(self) -> None:
        """Return once the abort has come."""
        await self._aborted.wait()

    @property
    def pending(self) -> int:
        """Sequences with output waiting for the writer."""
        return len(self._pending)


class SequenceSink:
    """One sequence's end of a DeltaQueue: what the engine puts there is tagged with the
    sequence's index."""

    __slots__ = ("index", "queue")

    def __init__(self, queue: DeltaQueue, index: int):
        self.queue = queue  # the response's channel
        self.index = index  # the sequence's position in the response

    def put_nowait(self, item: OutputDelta | Exception) -> None:
        """Take the sequence's delta, or the exception that ends it."""
        self.queue.put_nowait((self.index, item))
