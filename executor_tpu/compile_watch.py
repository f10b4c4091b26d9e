"""Counting XLA compilations: warm-up totals, and any compilation after warm-up.

torch_xla's ``CompileTime`` metric counts every program compiled in the process (cache hits in
memory do not count). The runner marks the end of warm-up; from then on each step checks the
count, and a step that compiled logs a warning. The counts are Prometheus gauges in the
process's default registry (served with ``--metrics-port``):

- ``tandem:xla_compilations_after_warmup`` — programs compiled since the last warm-up (0 when
  every step shape was precompiled);
- ``tandem:xla_warmup_compilations`` / ``tandem:xla_warmup_compile_seconds`` — programs compiled
  by the last warm-up and the compiler time they took;
- ``tandem:xla_warmup_seconds`` — wall time of the last warm-up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch_xla.debug.metrics as met

log = logging.getLogger(__name__)

_GAUGES: dict[str, object] = {}


def _gauge(name: str, doc: str):
    """A gauge in the default Prometheus registry, created once per process (None without
    prometheus_client)."""
    if name not in _GAUGES:
        try:
            from prometheus_client import Gauge
        except ImportError:  # metrics are optional
            _GAUGES[name] = None
        else:
            _GAUGES[name] = Gauge(name, doc)
    return _GAUGES[name]


def _set(name: str, doc: str, value: float) -> None:
    gauge = _gauge(name, doc)
    if gauge is not None:
        gauge.set(value)


@dataclass
class CompileStats:
    """torch_xla's compilation counters at one moment."""

    count: int  # programs compiled so far in this process
    seconds: float  # compiler time they took

    @classmethod
    def now(cls) -> CompileStats:
        data = met.metric_data("CompileTime")
        if not data:
            return cls(0, 0.0)
        return cls(int(data[0]), float(data[1]) / 1e9)


def persistent_cache_counters() -> dict[str, int]:
    """Hits, misses and failed loads of the persistent compilation cache so far."""
    names = ("PersistentCacheHit", "PersistentCacheMiss", "PersistentCacheDeserializeFailure")
    return {name: int(met.counter_value(name) or 0) for name in names}


class CompileWatch:
    """Counts compilations during and after warm-up."""

    def __init__(self) -> None:
        self.warmup_start: CompileStats | None = None  # counters when warm-up began
        self.baseline: CompileStats | None = None  # counters when warm-up ended
        self.after_warmup = 0  # programs compiled since warm-up ended
        self.warmup_compilations = 0  # programs compiled by the last warm-up
        self.warmup_compile_seconds = 0.0  # their compiler time
        _set(
            "tandem:xla_compilations_after_warmup",
            "XLA programs compiled after warm-up (0 when every shape was precompiled)",
            0,
        )

    def start_warmup(self) -> None:
        """Warm-up begins: compilations are expected."""
        self.warmup_start = CompileStats.now()
        self.baseline = None

    def end_warmup(self, seconds: float) -> int:
        """Warm-up is over; returns the programs it compiled."""
        assert self.warmup_start is not None, "start_warmup() first"
        now = CompileStats.now()
        self.warmup_compilations = now.count - self.warmup_start.count
        self.warmup_compile_seconds = now.seconds - self.warmup_start.seconds
        self.baseline, self.after_warmup = now, 0
        _set(
            "tandem:xla_warmup_compilations",
            "XLA programs compiled by the last warm-up",
            self.warmup_compilations,
        )
        _set(
            "tandem:xla_warmup_compile_seconds",
            "compiler seconds of the last warm-up",
            self.warmup_compile_seconds,
        )
        _set("tandem:xla_warmup_seconds", "wall seconds of the last warm-up", seconds)
        _set(
            "tandem:xla_compilations_after_warmup",
            "XLA programs compiled after warm-up (0 when every shape was precompiled)",
            0,
        )
        return self.warmup_compilations

    def check(self, what: str) -> int:
        """After a step: count (and warn about) compilations since warm-up; returns the
        programs this step compiled."""
        if self.baseline is None:
            return 0
        total = CompileStats.now().count - self.baseline.count
        new = total - self.after_warmup
        if new > 0:
            self.after_warmup = total
            log.warning(
                "%s compiled %d XLA program(s) after warm-up (%d in all): a shape was "
                "not precompiled",
                what,
                new,
                total,
            )
            _set(
                "tandem:xla_compilations_after_warmup",
                "XLA programs compiled after warm-up (0 when every shape was precompiled)",
                total,
            )
        return max(new, 0)
