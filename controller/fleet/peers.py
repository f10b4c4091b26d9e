"""The other controllers of the fleet: found like executors, probed, and the division of the
executors between the live ones.

Peers come from `--peer` (static), `--peer-dns` (every record of a name, e.g. a headless
Service) and `--peer-file`, re-resolved every `discovery_interval` (discovery.py). Each is
probed every `peer_probe_interval` with `GET /peer` (routes_ops.py), which a controller answers
200 with its advertised address, owner id and load (requests in flight, for prefix affinity's
load bound) while it serves and is not draining. A peer is live
while its last good answer is at most `LIVE_PERIODS` probe periods old (division.PeerTable);
the controller itself is always live in its own view, and an answer carrying its own owner id
(its own address listed among the peers) is recognised and skipped. When the live set changes,
`on_change` is called; the engine then assigns each executor to its controller
(division.divide over the live controllers' advertised addresses).

The probe is plain HTTP/1.1 (HTTPS when this controller serves HTTPS, without verifying the
peer's certificate: an answer is a liveness hint, never a credential; executors' leases are
what keeps one executor to one controller).
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from collections.abc import Callable

from controller.fleet.discovery import Discovery, peer_sources, split_host_port
from controller.fleet.division import PeerTable, divide
from controller.settings import ControllerConfig

log = logging.getLogger(__name__)

PEER_PATH = "/peer"  # the route every controller answers its peers on
LIVE_PERIODS = 3  # probe periods a peer stays live after its last good answer
MAX_ANSWER_BYTES = 4096  # a /peer answer is a few hundred bytes; read no more than this


class Peers:
    """The other controllers: their liveness, and the division of the executors."""

    def __init__(self, config: ControllerConfig, owner_id: str, on_change: Callable[[], None]):
        sources = peer_sources(config)
        self.enabled = bool(sources)  # without peers this controller drives every executor
        self.owner_id = owner_id  # this controller's (an answer carrying it is our own)
        self.self_key = config.advertise_address  # this controller's name in the division
        self.interval = config.peer_probe_interval  # seconds between probes
        self.discovery = Discovery(config, sources) if sources else None  # where peers are
        self.table = PeerTable(self.self_key, LIVE_PERIODS * self.interval)  # their answers
        self.addresses: set[str] = set()  # probe addresses now listed
        self.live: list[str] = [self.self_key]  # live controllers' keys, at the last round
        self.on_change = on_change  # called when `live` changes
        self._tls = unverified_tls() if config.ssl_certfile else None  # HTTPS peers
        self._resolve_every = config.discovery_interval  # seconds between re-resolutions
        self._task: asyncio.Task | None = None  # the probe loop

    async def start(self) -> None:
        """One round (so that the first division knows the peers already up), then the loop."""
        if not self.enabled:
            return
        await self._resolve()
        await self._probe_all()
        self._task = asyncio.create_task(self._loop(), name="peers")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def divide(self, executors: list[str]) -> dict[str, str]:
        """executor address -> the key of the live controller that drives it."""
        return divide(executors, self.live)

    def loads(self) -> dict[str, int]:
        """The live peers (this controller not included) and the requests each had in flight
        at its last answer (prefix affinity's load bound, fleet/affinity.py)."""
        loads = self.table.loads(time.monotonic())
        return {key: loads.get(key, 0) for key in self.live if key != self.self_key}

    def owner_of(self, key: str) -> str:
        """The owner id of the peer advertising `key` ("" if unknown)."""
        return self.table.owner_of(key)

    async def _loop(self) -> None:
        resolved = time.monotonic()
        while True:
            await asyncio.sleep(self.interval)
            try:
                if time.monotonic() - resolved >= self._resolve_every:
                    resolved = time.monotonic()
                    await self._resolve()
                await self._probe_all()
            except Exception:  # keep probing whatever one round did
                log.exception("peer round failed")

    async def _resolve(self) -> None:
        assert self.discovery is not None
        self.addresses = set(await self.discovery.resolve())
        self.table.forget(self.addresses)

    async def _probe_all(self) -> None:
        await asyncio.gather(*(self._probe(a) for a in sorted(self.addresses)))
        live = self.table.live(time.monotonic())
        if live != self.live:
            log.info("live controllers: %s (was %s)", ", ".join(live), ", ".join(self.live))
            self.live = live
            self.on_change()

    async def _probe(self, address: str) -> None:
        timeout = max(self.interval, 0.5)
        try:
            answer = await asyncio.wait_for(probe(address, self._tls), timeout)
        except (OSError, TimeoutError, ValueError) as exc:
            log.debug("peer %s: no answer (%r)", address, exc)
            return
        owner, key = answer.get("owner"), answer.get("address")
        if owner == self.owner_id or not isinstance(key, str) or not isinstance(owner, str):
            return  # ourselves, or not a controller's answer
        if key == self.self_key:
            log.warning("peer %s advertises this controller's own address %s", address, key)
            return
        load = answer.get("load", 0)
        load = load if isinstance(load, int) and load >= 0 else 0
        self.table.answered(address, key, owner, time.monotonic(), load)


def unverified_tls() -> ssl.SSLContext:
    """TLS to peers that serve HTTPS, for their probes and forwarded requests; their
    certificates are not checked (an answer is a liveness hint, module docstring)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


async def probe(address: str, tls: ssl.SSLContext | None = None) -> dict:
    """The JSON of a 200 answer to GET /peer at host:port; ValueError for any other answer."""
    host, port = split_host_port(address)
    reader, writer = await asyncio.open_connection(host, port, ssl=tls)
    try:
        request = f"GET {PEER_PATH} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n"
        writer.write(request.encode("ascii"))
        await writer.drain()
        data = b""
        while len(data) <= MAX_ANSWER_BYTES:
            chunk = await reader.read(MAX_ANSWER_BYTES + 1 - len(data))
            if not chunk:
                break
            data += chunk
    finally:
        writer.close()
    head, sep, body = data.partition(b"\r\n\r\n")
    status = head.split(b"\r\n", 1)[0].split()
    if not sep or len(status) < 2 or status[1] != b"200" or len(data) > MAX_ANSWER_BYTES:
        raise ValueError(f"not a 200 answer: {head[:80]!r}")
    answer = json.loads(body)
    if not isinstance(answer, dict):
        raise ValueError("not a JSON object")
    return answer
