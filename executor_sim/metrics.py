"""Prometheus counters of a simulated executor, and the probe that sizes incoming steps.

Counters live in prometheus_client's default registry, which ``--metrics-port`` serves:

- ``tandem_sim:steps_total`` / ``tandem_sim:busy_seconds_total``: steps run and the seconds
  spent in them (processing plus the modeled sleep); busy / wall time is the device's duty.
- ``tandem_sim:modeled_seconds_total``: what the latency model asked for (busy exceeds it when
  the simulator itself is slower than the model).
- ``tandem_sim:step_request_bytes_total``: serialized size of the StepRequests received.
- ``tandem_sim:scheduled_requests_total``, ``tandem_sim:scheduled_tokens_total``,
  ``tandem_sim:sampled_tokens_total``: work done.
- ``tandem_sim:decode_steps_total``, ``tandem_sim:decode_step_request_bytes_total``,
  ``tandem_sim:decode_scheduled_requests_total``: the same for pure decode steps only.
- ``tandem_sim:running_requests``: requests the executors of this process hold.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, disable_created_metrics

from common.wire import convert

_PREFIX = "tandem_sim:"
_sizes: dict[int, int] = {}  # id() of a decoded StepInput -> its StepRequest size, until run
# (by object, not step id: executors in one process each count their own steps from 1)
# Steps decoded but not yet run, across the process's executors (two or so each); older ones
# never ran (their stream was replaced).
_MAX_PENDING_SIZES = 4096
_shared: SimMetrics | None = None  # the process's counters, created on first use


class SimMetrics:
    """The simulator's counters (one set per process: the default registry)."""

    def __init__(self) -> None:
        disable_created_metrics()  # this process serves only these series: keep them lean

        def counter(name: str, doc: str) -> Counter:
            return Counter(_PREFIX + name, doc)

        self.steps = counter("steps", "Steps run.")
        self.busy_seconds = counter("busy_seconds", "Seconds spent running steps.")
        self.modeled_seconds = counter("modeled_seconds", "Step seconds the latency model asked.")
        self.request_bytes = counter("step_request_bytes", "Bytes of StepRequests received.")
        self.scheduled_requests = counter("scheduled_requests", "Requests scheduled in steps.")
        self.scheduled_tokens = counter("scheduled_tokens", "Tokens scheduled in steps.")
        self.sampled_tokens = counter("sampled_tokens", "Tokens sampled.")
        self.decode_steps = counter("decode_steps", "Pure decode steps.")
        self.decode_bytes = counter(
            "decode_step_request_bytes", "Bytes of the StepRequests of pure decode steps."
        )
        self.decode_requests = counter(
            "decode_scheduled_requests", "Requests scheduled in pure decode steps."
        )
        self.running = Gauge(_PREFIX + "running_requests", "Requests the executor holds.")


def shared_metrics() -> SimMetrics:
    """The process's counters (a registry holds each name once, so there is one set)."""
    global _shared
    if _shared is None:
        _shared = SimMetrics()
    return _shared


def install_step_size_probe() -> None:
    """Record the serialized size of every StepRequest the servicer decodes.

    The servicer turns each incoming message into a StepInput with ``convert.step_from_pb``
    (looked up at call time); wrapping it here measures the exact wire size without touching
    the servicer. Steps are decoded ahead on a reader thread, so sizes are kept by step and
    read back by ``take_step_bytes`` when the step runs.
    """
    original = convert.step_from_pb
    if getattr(original, "sim_probe", False):
        return

    def probed(message):
        step = original(message)
        _sizes[id(step)] = message.ByteSize()
        if len(_sizes) > _MAX_PENDING_SIZES:  # a step decoded ahead whose stream was dropped
            _sizes.pop(next(iter(_sizes)), None)  # another executor's thread may race us
        return step

    probed.sim_probe = True  # type: ignore[attr-defined]
    convert.step_from_pb = probed


def take_step_bytes(step) -> int:
    """The size of ``step``'s StepRequest (0 if not recorded), then forget it."""
    return _sizes.pop(id(step), 0)
