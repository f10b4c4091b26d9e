"""The executor's step pipeline: a stream's steps decoded and run ahead on threads of their
own, so that protobuf decoding and the result's send overlap the device's work; where the
runner splits a step into a launch and a finish, each step launched before the one in flight
is finished, so that its host work overlaps that step's device work (``run_overlapped``)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from common.wire import convert
from common.wire.step_types import StepInput

_END = object()


class StepsAhead:
    """The stream's steps, read and converted from protobuf on a reader thread, so that a step
    the controller sent ahead (pipelined) is ready when the one running ends: its decoding
    overlaps the device's work instead of following it. An error reading the stream (it was
    cancelled) is raised in order, after the steps before it. The queue is unbounded: the
    controller bounds the steps in flight."""

    def __init__(self, requests):
        self._ready, _ = _on_thread((convert.step_from_pb(r) for r in requests), "step-reader")
        self._ended = False  # the stream's end (or its error) was taken

    def take(self, wait: bool = True, timeout: float | None = None) -> StepInput | None:
        """The next step; None at the stream's end, or when none has arrived (``wait`` False)
        or arrives within ``timeout`` seconds (``ended`` tells the two apart)."""
        if self._ended:
            return None
        if not wait and self._ready.empty():
            return None
        try:
            item = self._ready.get(timeout=timeout)
        except queue.Empty:
            return None
        if item is _END or isinstance(item, Exception):
            self._ended = True
            if item is not _END:
                raise item
            return None
        return item

    @property
    def ended(self) -> bool:
        """Whether the stream's end was taken."""
        return self._ended

    def __iter__(self) -> Iterator[StepInput]:
        while (step := self.take()) is not None:
            yield step


def decoded_ahead(requests) -> Iterator[StepInput]:
    """The stream's steps decoded ahead on a reader thread (``StepsAhead``), in order."""
    yield from StepsAhead(requests)


def run_ahead(steps: Iterator[StepInput], execute) -> Iterator:
    """The outputs of ``execute`` over ``steps``, run on a thread of their own: while the
    stream's thread converts and sends step N's result, the device already runs step N+1, as
    an asynchronous executor would (the send waits for gRPC's write to complete). Errors,
    the servicer's aborts included, are raised here after the outputs before them. When the consumer
    stops (the stream ended), no further step is started."""
    stopped = threading.Event()

    def outputs():
        for step in steps:
            if stopped.is_set():
                return
            yield execute(step)

    return _run_on_thread(outputs(), stopped)


@dataclass
class OverlapCounts:
    """What ``run_overlapped`` did on one stream (for its closing log line)."""

    launched: int = 0  # steps launched
    overlapped: int = 0  # of those, launched while another step was in flight


#: How often a step in flight is checked for completion while the next step is awaited.
DONE_POLL_SECONDS = 0.0002


def run_overlapped(
    steps: StepsAhead,
    launch: Callable[[StepInput], object],
    finish: Callable[[object], object],
    finish_first: Callable[[StepInput], bool],
    done: Callable[[object], bool],
    counts: OverlapCounts | None = None,
) -> Iterator:
    """The outputs of steps split into ``launch`` (the step's device work queued) and
    ``finish`` (waiting for it, its output), run on a thread of their own: a step that arrives
    while another is in flight is launched before that one is finished, so the device goes
    from one to the next while the host builds the next one's inputs and then reads the
    previous one's results. A step in flight is finished as soon as its device work is
    ``done`` if no next step has arrived by then (its result never waits for the controller),
    and before launching a step that ``finish_first`` says needs its results. Outputs come in
    step order; a launch that raises is raised after the output of the step in flight before
    it, and so is an error reading the stream. When the consumer stops (the stream ended), no
    further step is launched and the step in flight is still finished. ``counts`` (if given)
    counts the launches."""
    stopped = threading.Event()
    counts = counts if counts is not None else OverlapCounts()

    def next_step(pending):
        """The next step: waiting for it when nothing is in flight, else only until the step
        in flight is done (None then)."""
        if stopped.is_set():
            return None
        if pending is None:
            return steps.take()
        step = steps.take(wait=False)
        while step is None and not steps.ended and not stopped.is_set() and not done(pending):
            step = steps.take(timeout=DONE_POLL_SECONDS)
        return step

    def outputs():
        pending = None  # the launched step not yet finished
        while True:
            try:
                step = next_step(pending)
            except Exception:
                if pending is not None:
                    yield finish(pending)
                raise
            if step is None:
                if pending is not None:
                    yield finish(pending)
                    pending = None
                if stopped.is_set() or steps.ended:
                    return
                continue
            if pending is not None and finish_first(step):
                yield finish(pending)
                pending = None
            try:
                launched = launch(step)
            except Exception:
                if pending is not None:
                    yield finish(pending)
                raise
            counts.launched += 1
            if pending is not None:
                counts.overlapped += 1
                yield finish(pending)
            pending = launched

    return _run_on_thread(outputs(), stopped)


def _run_on_thread(outputs: Iterator, stopped: threading.Event) -> Iterator:
    """Iterate ``outputs`` on the step-runner thread; stop it when the consumer stops."""
    ready, runner = _on_thread(outputs, "step-runner")
    try:
        yield from _drain(ready)
    finally:
        stopped.set()
        runner.join(timeout=30)  # a step already started finishes before the stream counts closed


def _on_thread(items: Iterator, name: str) -> tuple[queue.SimpleQueue, threading.Thread]:
    """Iterate ``items`` on a daemon thread into a queue (see ``_drain``): its values in
    order, then an exception it raised, then the end marker."""
    ready: queue.SimpleQueue = queue.SimpleQueue()

    def run() -> None:
        try:
            for item in items:
                ready.put(item)
        except Exception as exc:  # surfaced to the consumer, in order
            ready.put(exc)
        finally:
            ready.put(_END)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return ready, thread


def _drain(ready: queue.SimpleQueue) -> Iterator:
    """What ``_on_thread`` queued, until its end; an exception it queued is raised here."""
    while True:
        item = ready.get()
        if item is _END:
            return
        if isinstance(item, Exception):
            raise item
        yield item
