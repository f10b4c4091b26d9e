"""Forwarding to the home controller (controller/api/forwarding.py), in process: which requests
go, what the home receives, what the client gets back, and when the request stays here."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry

from controller.api.forwarding import FORWARDED_HEADER, Forwarder

SELF, PEER = "10.0.0.1:8000", "10.0.0.2:8000"


def config(**overrides) -> SimpleNamespace:
    values = dict(
        peer_affinity=True,
        peer_affinity_key_tokens=256,
        peer_affinity_load_factor=1.25,
        peer_affinity_connect_timeout=1.0,
        ssl_certfile="",
    )
    return SimpleNamespace(**{**values, **overrides})


def peers(enabled: bool = True) -> SimpleNamespace:
    return SimpleNamespace(
        enabled=enabled, self_key=SELF, live=[SELF, PEER], interval=0.05, loads=lambda: {PEER: 0}
    )


def forwarder(home, **overrides) -> tuple[Forwarder, list[httpx.Request]]:
    """A forwarder whose home controller is `home` (an httpx MockTransport handler); the
    requests the home received."""
    seen: list[httpx.Request] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return await home(request)

    fwd = Forwarder(config(**overrides), peers(), CollectorRegistry())
    fwd._client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return fwd, seen


def prompt_homed(fwd: Forwarder, at_peer: bool) -> list[int]:
    rng = random.Random(3)
    while True:
        tokens = [rng.randrange(50_000) for _ in range(300)]
        if (fwd.home(tokens, 0) == PEER) == at_peer:
            return tokens


def serve(fwd: Forwarder, tokens: list[int], headers: dict) -> httpx.Response:
    """POST /v1/completions to an app that answers {"served": "here"} unless forwarded."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(request: Request):
        forwarded = await fwd.route(request, tokens, 0, 5.0)
        return forwarded or JSONResponse({"served": "here"})

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post("/v1/completions?x=1", content=b'{"a": 1}', headers=headers)

    return asyncio.run(main())


def count(fwd: Forwarder, outcome: str) -> float:
    return fwd.outcomes.labels(outcome)._value.get()


class Events(httpx.AsyncByteStream):
    """A body the home writes in two events, as a network stream (read once)."""

    async def __aiter__(self):
        yield b"data: 1\n\n"
        yield b"data: [DONE]\n\n"


async def answered(request: httpx.Request) -> httpx.Response:
    headers = {"content-type": "text/event-stream", "x-request-id": "home-id", "server": "h"}
    return httpx.Response(200, headers=headers, stream=Events())


def test_a_request_whose_home_is_a_peer_is_relayed_unchanged():
    fwd, seen = forwarder(answered)
    headers = {"Authorization": "Bearer k", "X-Request-Id": "client-1", "X-Other": "v"}
    resp = serve(fwd, prompt_homed(fwd, True), headers)
    assert resp.status_code == 200 and resp.content == b"data: 1\n\ndata: [DONE]\n\n"
    assert resp.headers["content-type"] == "text/event-stream"
    assert "server" not in resp.headers and "x-request-id" not in resp.headers  # ours add them
    (sent,) = seen
    assert str(sent.url) == f"http://{PEER}/v1/completions?x=1" and sent.content == b'{"a": 1}'
    assert sent.headers["authorization"] == "Bearer k" and sent.headers["x-other"] == "v"
    assert sent.headers[FORWARDED_HEADER] == SELF
    assert sent.headers.get_list("x-request-id") == [sent.headers["x-request-id"]]  # one
    assert count(fwd, "forwarded") == 1 and fwd.in_flight == {}  # over: not in flight


def test_requests_that_stay_here():
    fwd, seen = forwarder(answered)
    assert serve(fwd, prompt_homed(fwd, False), {}).json() == {"served": "here"}
    assert serve(fwd, list(range(10)), {}).json() == {"served": "here"}  # no key
    forged = {FORWARDED_HEADER: "anyone"}
    assert serve(fwd, prompt_homed(fwd, True), forged).json() == {"served": "here"}
    assert seen == []
    assert count(fwd, "local") == 2 and count(fwd, "for_peer") == 1
    off, seen = forwarder(answered, peer_affinity=False)
    assert serve(off, prompt_homed(fwd, True), {}).json() == {"served": "here"} and seen == []


def test_a_refusing_or_unreachable_home_leaves_the_request_here():
    async def draining(request):
        return httpx.Response(503, json={"error": "draining"})

    async def unreachable(request):
        raise httpx.ConnectError("refused", request=request)

    for home in (draining, unreachable):
        fwd, seen = forwarder(home)
        assert serve(fwd, prompt_homed(fwd, True), {}).json() == {"served": "here"}
        assert len(seen) == 1 and count(fwd, "fallback") == 1


def test_a_home_that_leaves_before_answering_leaves_the_request_here():
    async def frozen(request):
        await asyncio.sleep(30)

    fwd, _ = forwarder(frozen)
    tokens = prompt_homed(fwd, True)
    fwd.peers.live = [SELF]  # it leaves the live set while the request waits
    fwd.peers.loads = lambda: {}
    fwd.home = lambda tokens, load: PEER  # chosen while it was still live
    assert serve(fwd, tokens, {}).json() == {"served": "here"}
    assert count(fwd, "fallback") == 1
