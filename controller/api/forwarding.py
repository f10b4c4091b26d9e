"""Prefix affinity across controllers: a request is served by its home controller, the one its
prompt's leading tokens hash to (controller/fleet/affinity.py), so that requests sharing a
prefix meet on the executors that cache it.

The controller that receives a request tokenizes it as usual; when the home is another live
peer, it sends the same HTTP request there (body and headers unchanged, Authorization included,
its X-Request-Id set to this request's id) with `FORWARDED_HEADER`, and streams the home's
answer back unchanged, SSE included. The header only tells the home to serve the request itself
(no second hop, no loop); the home checks the API key, the limits and admission again, so a
client that forges the header gains nothing but being served where it connected. When the home
cannot be reached within the connect timeout, answers 503 or 429 (draining, no executor, full
queue) before any byte of a body, or leaves the live controllers before it answers (frozen or
dead after it accepted the connection), the request is served here. Once the home's answer has
started it is the client's answer: if the home dies mid-stream, the client's response ends
there (as it would had it connected to the home).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import AsyncIterator

import httpx
from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse
from prometheus_client import CollectorRegistry, Counter

from controller.api.request_ids import HEADER as REQUEST_ID_HEADER
from controller.api.request_ids import request_ids
from controller.api.stall import StallBoundedStream
from controller.fleet.affinity import home_of, routing_key
from controller.fleet.peers import Peers, unverified_tls
from controller.settings import ControllerConfig

log = logging.getLogger(__name__)

FORWARDED_HEADER = "X-Tandem-Forwarded-By"  # set on a forwarded request: serve it, no new hop
# Request headers not passed on: the connection's own, and the ones this hop sets itself.
_DROP_REQUEST = frozenset(
    {"host", "connection", "keep-alive", "transfer-encoding", "content-length", "te",
     "upgrade", "proxy-connection", REQUEST_ID_HEADER.lower(), FORWARDED_HEADER.lower()}
)  # fmt: skip
# Response headers not passed back: the connection's own, and the ones this server adds.
_DROP_RESPONSE = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "date", "server",
     REQUEST_ID_HEADER.lower()}
)  # fmt: skip
_SERVE_HERE = frozenset({429, 503})  # the home's answers that send the request back here


class Forwarder:
    """Sends requests to their home controller, or says to serve them here."""

    def __init__(self, config: ControllerConfig, peers: Peers, registry: CollectorRegistry):
        self.enabled = config.peer_affinity and peers.enabled  # no peers: nothing to do
        self.peers = peers  # the live controllers and their loads
        self.key_tokens = config.peer_affinity_key_tokens  # leading tokens in the key
        self.load_factor = config.peer_affinity_load_factor  # the bounded-load factor
        self.connect_timeout = config.peer_affinity_connect_timeout  # to reach the home
        self.scheme = "https" if config.ssl_certfile else "http"  # peers serve what we serve
        self.in_flight: dict[str, int] = {}  # home -> requests forwarded there, not over
        self._client: httpx.AsyncClient | None = None  # made on first use, in the server loop
        self.outcomes = Counter(
            "tandem:peer_affinity_requests",
            "Requests by where prefix affinity served them: local (home here, or no key), "
            "forwarded (to their home), fallback (home unreachable or refusing: served here), "
            "for_peer (forwarded here by a peer)",
            ["outcome"],
            registry=registry,
        )

    def home(self, tokens: list[int], local_load: int) -> str | None:
        """The peer that is this prompt's home, or None when it is this controller."""
        key = routing_key(tokens, self.key_tokens)
        if key is None:
            return None
        loads = {k: max(v, self.in_flight.get(k, 0)) for k, v in self.peers.loads().items()}
        loads[self.peers.self_key] = local_load
        home = home_of(key, loads, self.load_factor)
        return None if home == self.peers.self_key else home

    async def route(
        self, http: HTTPRequest, tokens: list[int], local_load: int, stall_timeout: float
    ) -> StreamingResponse | None:
        """The home's response to this request when its home is a reachable peer; None: serve
        it here (no peers, off, forwarded already, its home is here, or the home refused)."""
        if not self.enabled:
            return None
        if http.headers.get(FORWARDED_HEADER) is not None:
            self.outcomes.labels("for_peer").inc()
            return None
        home = self.home(tokens, local_load)
        if home is None:
            self.outcomes.labels("local").inc()
            return None
        response = await self._send(http, home)
        if response is None:
            self.outcomes.labels("fallback").inc()
            return None
        self.outcomes.labels("forwarded").inc()
        self.in_flight[home] = self.in_flight.get(home, 0) + 1
        return ProxiedResponse(response, stall_timeout, lambda: self._done(home))

    def _done(self, home: str) -> None:
        self.in_flight[home] -= 1
        if not self.in_flight[home]:
            del self.in_flight[home]

    async def _send(self, http: HTTPRequest, home: str) -> httpx.Response | None:
        """The home's response, its body not read yet; None when it cannot be reached or
        refuses (_SERVE_HERE) before any body."""
        headers = [(k, v) for k, v in http.headers.items() if k.lower() not in _DROP_REQUEST]
        headers += [
            (REQUEST_ID_HEADER, request_ids(http.scope).public),
            (FORWARDED_HEADER, self.peers.self_key),
        ]
        query = f"?{http.url.query}" if http.url.query else ""
        url = f"{self.scheme}://{home}{http.url.path}{query}"
        client = self._client_now()
        request = client.build_request("POST", url, content=await http.body(), headers=headers)
        try:
            response = await self._until_home_leaves(client.send(request, stream=True), home)
        except httpx.HTTPError as exc:
            log.warning("home controller %s unreachable (%r): served here", home, exc)
            return None
        if response is None:
            log.warning("home controller %s left before it answered: served here", home)
            return None
        if response.status_code in _SERVE_HERE:
            log.info("home controller %s answered %d: served here", home, response.status_code)
            await response.aclose()
            return None
        return response

    async def _until_home_leaves(self, sending, home: str) -> httpx.Response | None:
        """The home's response; None when the home drops out of the live controllers first (a
        frozen or dead home that accepted the connection would hold the request forever:
        a non-streamed answer's headers come only when it is complete, so no timeout fits)."""
        task = asyncio.ensure_future(sending)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.peers.interval)
                if done:
                    return task.result()
                if home not in self.peers.live:
                    return None
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def _client_now(self) -> httpx.AsyncClient:
        if self._client is None:
            # No read timeout: a long generation's next token may take long; the home bounds
            # its own requests, and the client's stall bounds our writes (ProxiedResponse).
            timeout = httpx.Timeout(None, connect=self.connect_timeout, write=self.connect_timeout)
            # HTTPS peers as they are probed (peers.py).
            verify: ssl.SSLContext | bool = unverified_tls() if self.scheme == "https" else True
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            self._client = httpx.AsyncClient(timeout=timeout, verify=verify, limits=limits)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()


class ProxiedResponse(StallBoundedStream):
    """The home's response, passed back byte for byte; every write bounded by the stall
    timeout like a local response's, and the home's connection closed however it ends."""

    kind = "forwarded"

    def __init__(self, upstream: httpx.Response, stall_timeout: float, on_done):
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _DROP_RESPONSE}
        super().__init__(_body(upstream), status_code=upstream.status_code, headers=headers)
        self.upstream = upstream  # the home's response
        self.stall_timeout = stall_timeout  # seconds one write may wait for the client
        self.on_done = on_done  # called once when the response is over

    async def finished(self) -> None:
        with contextlib.suppress(Exception):
            await self.upstream.aclose()  # the home sees its client leave and aborts
        self.on_done()


async def _body(upstream: httpx.Response) -> AsyncIterator[bytes]:
    """The home's body as it comes; a broken connection ends it where it broke."""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:
        log.warning("home controller's response broke off: %r", exc)
