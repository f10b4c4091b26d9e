"""The control-plane benchmark's load generator, in a process of its own.

It keeps R completions in flight against a controller (closed loop: a finished one is
replaced) until told to stop. Running it in its own process keeps its CPU out of the
measurement's process and lets the benchmark read it apart (`cpu_seconds(pid)`).

Streamed requests (`stream: true`) are read over plain asyncio sockets: one HTTP/1.1 keep-alive
connection per worker, the SSE body counted as it arrives (chunks, and whether ``[DONE]`` and the
chunked terminator came), never parsed. An HTTP client that parses every event would cost more
CPU per chunk than the controller that writes it, on the same two cores.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import random
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

END_OF_BODY = b"\r\n0\r\n\r\n"  # the last chunk of a chunked body


@dataclass
class LoadSpec:
    """What to send: picklable, for the load process."""

    base_urls: list[str]  # the controllers' http://host:port; worker i sends to the (i mod n)th
    model: str  # served model name
    running: int  # requests kept in flight
    input_len: int  # prompt tokens
    output_len: int  # max tokens per request
    vocab: int  # prompt ids are drawn below this
    stream: bool  # stream: true, SSE read as it comes


def request_body(spec: LoadSpec, rng: random.Random) -> dict:
    """One completion request of random prompt ids."""
    body = {
        "model": spec.model,
        "prompt": [rng.randrange(100, spec.vocab) for _ in range(spec.input_len)],
        "max_tokens": spec.output_len,
        "temperature": 0,
        "ignore_eos": True,
    }
    if spec.stream:
        body["stream"] = True
    return body


async def read_response(reader: asyncio.StreamReader) -> tuple[int, int]:
    """Read one response to its end: (status, SSE events seen). A streamed body is chunked."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    lower = head.lower()
    if b"content-length:" in lower:
        length = int(lower.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
        await reader.readexactly(length)
        return status, 0
    events, tail = 0, b""
    while True:
        data = await reader.read(1 << 16)
        if not data:
            raise ConnectionError("the server closed the stream")
        events += data.count(b"data: ")
        tail = (tail + data)[-len(END_OF_BODY) :]
        if tail == END_OF_BODY:
            return status, events


async def stream_worker(spec: LoadSpec, seed: int, stop: asyncio.Event, counts: list) -> None:
    """Streamed requests one after another on one keep-alive connection."""
    url = urlsplit(spec.base_urls[seed % len(spec.base_urls)])
    rng = random.Random(seed)
    writer = None
    while not stop.is_set():
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection(url.hostname, url.port)
            payload = json.dumps(request_body(spec, rng)).encode()
            writer.write(
                b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json"
                b"\r\nContent-Length: %d\r\n\r\n%s" % (url.netloc.encode(), len(payload), payload)
            )
            status, events = await read_response(reader)
            counts[0] += events
            if status != 200:
                await asyncio.sleep(0.1)
        except (OSError, asyncio.IncompleteReadError, ValueError, ConnectionError):
            if writer is not None:
                writer.close()
            writer = None
            await asyncio.sleep(0.1)
    if writer is not None:
        writer.close()


async def whole_worker(spec: LoadSpec, seed: int, client: httpx.AsyncClient, stop) -> None:
    """Non-streamed requests one after another."""
    rng = random.Random(seed)
    base_url = spec.base_urls[seed % len(spec.base_urls)]
    while not stop.is_set():
        try:
            await client.post(base_url + "/v1/completions", json=request_body(spec, rng))
        except httpx.HTTPError:
            await asyncio.sleep(0.1)


async def keep_in_flight(spec: LoadSpec, stop: asyncio.Event, counts: list) -> None:
    """Keep `spec.running` requests in flight until `stop` (then abort them)."""
    # Pools of at most 20 connections: httpx's pool scans every connection per request.
    sizes = [min(20, spec.running - i) for i in range(0, spec.running, 20)]
    clients = [
        httpx.AsyncClient(
            timeout=None, limits=httpx.Limits(max_connections=n, max_keepalive_connections=n)
        )
        for n in ([] if spec.stream else sizes)
    ]
    try:
        if spec.stream:
            tasks = [
                asyncio.create_task(stream_worker(spec, i, stop, counts))
                for i in range(spec.running)
            ]
        else:
            pairs = [(c, n) for c, n in zip(clients, sizes)]
            tasks = [
                asyncio.create_task(whole_worker(spec, 20 * k + j, c, stop))
                for k, (c, n) in enumerate(pairs)
                for j in range(n)
            ]
        await stop.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for c in clients:
            await c.aclose()


def _process_main(spec: LoadSpec, stop_flag, events_out) -> None:
    """The load process: run until the parent sets `stop_flag`; report SSE events seen."""

    async def run() -> None:
        stop = asyncio.Event()
        counts = [0]

        async def watch() -> None:
            while not stop_flag.is_set():
                await asyncio.sleep(0.2)
            events_out.value = counts[0]
            stop.set()

        watcher = asyncio.create_task(watch())
        await keep_in_flight(spec, stop, counts)
        await watcher

    asyncio.run(run())


class LoadProcess:
    """The load generator in a child process (spawned: no state inherited from the parent)."""

    def __init__(self, spec: LoadSpec):
        ctx = multiprocessing.get_context("spawn")
        self.stop_flag = ctx.Event()  # set: the workers stop
        self.events = ctx.Value("q", 0)  # SSE events read, written when it stops
        self.process = ctx.Process(
            target=_process_main, args=(spec, self.stop_flag, self.events), daemon=True
        )
        self.process.start()

    @property
    def pid(self) -> int:
        """The load process's pid (its CPU is read from /proc)."""
        assert self.process.pid is not None
        return self.process.pid

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the workers (their requests are aborted) and wait for the process."""
        self.stop_flag.set()
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
