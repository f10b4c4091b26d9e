"""Which controller owns this executor: an owner id with a lease, and the session generation
that fences out every other.

Every InitDevice starts a new session with a new generation (monotonic per process). A named
owner holds the session under a lease it keeps alive (RenewLease); while the lease lives,
InitDevice from another owner is refused, and once another owner takes the executor (after
the lease expired, or was released) every call of an older generation is refused: a stale
controller can never drive the device again with its old session.

An empty owner id is an ownerless session (one controller, a test or a tool calling InitDevice
by hand): it has no lease and any InitDevice replaces it, as before owners existed; but it
cannot take the executor from a named owner whose lease lives.

The lease does not run out while a call of its own session is in progress (a warm-up may take
minutes, before the controller renews from its health loop): it restarts when the call ends.
A renewal after the deadline still succeeds while no one else took the executor.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

DEFAULT_LEASE_SECONDS = 10.0  # granted to a named owner that asks for 0
MIN_LEASE_SECONDS = 1.0  # shorter asks are raised to this


@dataclass
class Grant:
    """A session granted by InitDevice."""

    generation: int  # the session's generation: every later call of the session carries it
    lease_seconds: float  # the lease granted (0: an ownerless session, no lease)


class LeaseHeld(Exception):
    """Another owner's lease lives: the executor is not granted."""

    def __init__(self, owner: str, seconds_left: float):
        super().__init__(
            f"executor owned by {owner!r} (lease expires in {seconds_left:.1f}s unless renewed)"
        )
        self.owner = owner  # the current owner
        self.seconds_left = seconds_left  # until its lease expires, if not renewed
        self.repeated = False  # the same owner was refused for the same holder last time


class LeaseLost(Exception):
    """A call of a session that is not (or no longer) the executor's current one."""


class SessionLease:
    """The executor's current session: its generation, owner and lease. Thread-safe."""

    def __init__(
        self,
        max_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        start: int | None = None,
    ):
        self.max_seconds = max(max_seconds, MIN_LEASE_SECONDS)  # longest lease granted
        self.clock = clock  # monotonic seconds (a fake one in tests)
        # The current session's generation (`start`: none yet). It starts from the process's
        # start time in milliseconds, so that a restarted executor never grants a generation a
        # controller still holds from the process before (fencing would not tell them apart).
        self.generation = time.time_ns() // 1_000_000 if start is None else start
        self.owner = ""  # the current session's owner ("": ownerless)
        self.lease_seconds = 0.0  # the current lease's length (0: no lease)
        self._deadline = 0.0  # when the current lease expires, if not renewed
        self._busy = 0  # calls of the current generation in progress (the lease holds)
        self._refused = ("", "")  # the last refusal: (the refused owner, the holder)
        self._lock = threading.Lock()

    # --- queries (callers hold no lock) --------------------------------------------------

    def seconds_left(self) -> float:
        """Until the current owner's lease expires (0 when none lives)."""
        with self._lock:
            return self._left()

    def state(self) -> tuple[int, str, float]:
        """(generation, owner, seconds left) now."""
        with self._lock:
            return self.generation, self.owner, self._left()

    def stale(self, generation: int) -> str:
        """Why a call of `generation` may not run ("" when it is the current session)."""
        with self._lock:
            return self._stale(generation)

    # --- changes ------------------------------------------------------------------------

    def grant(self, owner: str, requested_seconds: float) -> Grant:
        """A new session for `owner` (LeaseHeld while another owner's lease lives)."""
        with self._lock:
            if self.owner and self.owner != owner and self._left() > 0:
                refused = LeaseHeld(self.owner, self._left())
                refused.repeated = self._refused == (owner, self.owner)
                self._refused = (owner, self.owner)
                raise refused
            self.generation += 1
            self.owner = owner
            self.lease_seconds = self._bounded(requested_seconds) if owner else 0.0
            self._deadline = self.clock() + self.lease_seconds
            self._busy = 0
            return Grant(self.generation, self.lease_seconds)

    def renew(self, owner: str, generation: int) -> float:
        """Extend the lease of `owner`'s session `generation`; its length (LeaseLost when
        that session is not the current one)."""
        with self._lock:
            self._check(owner, generation)
            self._deadline = self.clock() + self.lease_seconds
            return self.lease_seconds

    def release(self, owner: str, generation: int) -> None:
        """End `owner`'s session now: the next owner is granted at once, and the released
        session's calls are refused (LeaseLost when that session is not the current one)."""
        with self._lock:
            self._check(owner, generation)
            self.generation += 1  # fences the released session's open stream
            self.owner, self.lease_seconds, self._deadline, self._busy = "", 0.0, 0.0, 0

    def session_of(self, generation: int | None) -> int:
        """The generation a call belongs to: the one it names, or without one the current
        session when it is ownerless (LeaseLost otherwise)."""
        with self._lock:
            if generation is None:
                if self.owner:
                    raise LeaseLost(
                        f"executor owned by {self.owner!r} (generation {self.generation}): "
                        "a call must carry its session generation"
                    )
                return self.generation
            reason = self._stale(generation)
            if reason:
                raise LeaseLost(reason)
            return generation

    @contextmanager
    def hold(self, generation: int) -> Iterator[None]:
        """While a call of session `generation` runs, its lease does not expire; it restarts
        when the call ends."""
        with self._lock:
            counted = generation == self.generation
            self._busy += counted
        try:
            yield
        finally:
            with self._lock:
                if counted and generation == self.generation:
                    self._busy -= 1
                    self._deadline = self.clock() + self.lease_seconds

    # --- under the lock -----------------------------------------------------------------

    def _left(self) -> float:
        if not self.owner:
            return 0.0
        if self._busy:
            return self.lease_seconds
        return max(self._deadline - self.clock(), 0.0)

    def _stale(self, generation: int) -> str:
        if generation == self.generation:
            return ""
        holder = f"owner {self.owner!r}" if self.owner else "no owner"
        return (
            f"session generation {generation} is stale: the executor's session is generation "
            f"{self.generation} ({holder})"
        )

    def _check(self, owner: str, generation: int) -> None:
        reason = self._stale(generation)
        if not reason and owner != self.owner:
            reason = f"session generation {generation} is owned by {self.owner!r}, not {owner!r}"
        if reason:
            raise LeaseLost(reason)

    def _bounded(self, requested: float) -> float:
        seconds = requested if requested > 0 else DEFAULT_LEASE_SECONDS
        return min(max(seconds, MIN_LEASE_SECONDS), self.max_seconds)
