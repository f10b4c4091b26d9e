"""Which executors the engine has sessions for, and which of them it drives.

Discovery (discovery.py) lists the executors: a session starts for each new address, and one
whose address left drains, then ends. With peers (peers.py), the live controllers divide the
executors between them (division.py): every time the executors or the live controllers change,
each session is told whose its executor is; a session that is another controller's stays idle
or hands its executor over (handover.py). Without peers every executor is this controller's.
`Engine` (engine.py) inherits `Membership`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from controller.fleet.session import ExecutorSession

if TYPE_CHECKING:
    from controller.fleet.channel_security import ChannelSecurity
    from controller.fleet.discovery import Discovery
    from controller.fleet.peers import Peers
    from controller.observe.metrics import EngineMetrics
    from controller.settings import ControllerConfig

log = logging.getLogger(__name__)


class Membership:
    """The engine's executor sessions as discovery and the division make them (`Engine`
    inherits it). It works on the engine's attributes declared here."""

    config: ControllerConfig  # discovery_interval
    metrics: EngineMetrics  # given to new sessions
    discovery: Discovery  # where executors are
    peers: Peers  # the other controllers, and the division
    sessions: dict[str, ExecutorSession]  # by address
    executor_security: ChannelSecurity  # TLS and token of every executor channel
    owner_id: str  # this controller process, as executors know it

    async def _discover(self) -> None:
        while True:
            await asyncio.sleep(self.config.discovery_interval)
            try:
                self._apply(await self.discovery.resolve())
            except Exception:  # keep discovering whatever one round did
                log.exception("discovery round failed")

    def _apply(self, found: dict[str, str]) -> None:
        """Start sessions for new addresses; drain the ones that left; divide again."""
        new: list[ExecutorSession] = []
        for address, source in found.items():
            session = self.sessions.get(address)
            if session is None:
                log.info("executor %s joined (%s)", address, source)
                session = self.sessions[address] = ExecutorSession(
                    self,  # the engine: a SessionOwner
                    self.config,
                    self.metrics,
                    address,
                    source,
                    self.executor_security,
                    self.owner_id,
                )
                new.append(session)
            elif session.leaving and session.rejoin():
                log.info("executor %s is back in discovery", address)
        for address, session in list(self.sessions.items()):
            if address not in found:
                session.leave()
        self._divide()
        for session in new:
            session.start()  # after its first assignment: one of another controller's idles

    def _divide(self) -> None:
        """Tell each session whose its executor is now (peers.py; nothing without peers)."""
        if not self.peers.enabled:
            return
        listed = [a for a, s in self.sessions.items() if not s.leaving]
        chosen = self.peers.divide(listed)
        for address in listed:
            key = chosen.get(address, self.peers.self_key)
            self.sessions[address].assign("" if key == self.peers.self_key else key)

    def peer_state(self) -> dict:
        """What GET /peer answers: this controller's name in the division, its owner id and
        how many executors it drives (never their addresses: those are for /admin)."""
        return {
            "address": self.peers.self_key,
            "owner": self.owner_id,
            "owned_executors": sum(s.healthy for s in self.sessions.values()),
            "live_controllers": len(self.peers.live),
        }
