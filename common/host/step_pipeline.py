"""The executor's step pipeline: a stream's steps decoded and run ahead on threads of their
own, so that protobuf decoding and the result's send overlap the device's work."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

from common.wire import convert
from common.wire.step_types import StepInput

_END = object()


def decoded_ahead(requests) -> Iterator[StepInput]:
    """The stream's steps, read and converted from protobuf on a reader thread, so that a step
    the controller sent ahead (pipelined) is ready when the one running ends: its decoding
    overlaps the device's work instead of following it. An error reading the stream (it was
    cancelled) is raised here, in order. The queue is unbounded: the controller bounds the steps
    in flight."""
    ready, _ = _on_thread((convert.step_from_pb(r) for r in requests), "step-reader")
    yield from _drain(ready)


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

    ready, runner = _on_thread(outputs(), "step-runner")
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
