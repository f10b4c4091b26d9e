"""What an executor session reports to whoever owns it (the engine), and the little it asks.

The owner drives; the session never calls up past this interface. Every call names the
executor by its address, the session's key in the fleet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from common.wire.config import DeviceInfo
    from controller.fleet.tracked import Tracked


class SessionOwner(Protocol):
    """The owner of executor sessions: told about readiness, finished and moved requests and
    the end of a session; asked whether an executor may join and how fast to assume it is."""

    def check_compatible(self, address: str, info: DeviceInfo) -> None:
        """Raise when the executor a handshake described cannot join the fleet."""

    def claim_incarnation(self, address: str, incarnation: str) -> str:
        """Let the session at `address` drive the executor process `incarnation`; the address
        of the session that already drives it ("" when none: the claim is taken)."""

    def release_incarnation(self, address: str) -> None:
        """The session at `address` no longer drives the executor it claimed."""

    def cost_prior(self, address: str) -> tuple[float, float] | None:
        """(overhead, per_token) to start an unmeasured executor's step cost from; None keeps
        the default prior."""

    def session_ready(self, address: str) -> None:
        """A handshake finished: the session takes work."""

    def session_removed(self, address: str) -> None:
        """The session ended for good (its state is removed)."""

    def request_done(self, tracked: Tracked, reason: str | None, address: str, now: float) -> None:
        """A request finished on the executor (its metrics are counted already)."""

    def relocate(self, moved: list[Tracked], source: str) -> None:
        """The executor at `source` was lost: place these requests (detached) elsewhere."""
