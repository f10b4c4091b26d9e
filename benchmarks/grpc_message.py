"""What one gRPC message costs the controller's event-loop thread, by call shape and size.

A grpc.aio server and client in one process under uvloop (the controller's loop): a
bidirectional stream (what `ExecuteModel` uses: one write and one read per step) against a
unary call per step, at a few request sizes. Reported: wall and this thread's CPU per round
trip (the server's handler runs on the same loop, so the CPU covers both ends of the Python
side; grpc's own poller thread is left out).

    python benchmarks/grpc_message.py --sizes 64,3000,12000 --rounds 3000
"""

from __future__ import annotations

import argparse
import asyncio
import time

import grpc

try:
    import uvloop
except ImportError:  # pragma: no cover - the controller falls back to asyncio's loop too
    uvloop = None

REPLY = b"r" * 100  # a decode step's result: a packed array of a few hundred bytes


async def _unary(request: bytes, context) -> bytes:
    return REPLY


async def _bidi(requests, context):
    async for _ in requests:
        yield REPLY


async def measure(size: int, rounds: int) -> dict[str, tuple[float, float]]:
    """(wall us, thread CPU us) per round trip, per call shape."""
    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "bench.Bench",
        {
            "Unary": grpc.unary_unary_rpc_method_handler(_unary),
            "Stream": grpc.stream_stream_rpc_method_handler(_bidi),
        },
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    unary = channel.unary_unary("/bench.Bench/Unary")
    call = channel.stream_stream("/bench.Bench/Stream")()
    message = b"x" * size

    async def stream_step() -> None:
        await call.write(message)
        await call.read()

    async def unary_step() -> None:
        await unary(message)

    out = {}
    for name, step in (("stream", stream_step), ("unary", unary_step)):
        for _ in range(200):  # warm-up
            await step()
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(rounds):
            await step()
        out[name] = (
            1e6 * (time.perf_counter() - wall) / rounds,
            1e6 * (time.thread_time() - cpu) / rounds,
        )
    await channel.close()
    await server.stop(None)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="64,3000,12000", help="request bytes, comma-separated")
    p.add_argument("--rounds", type=int, default=3000, help="round trips measured per point")
    a = p.parse_args()
    run = uvloop.run if uvloop is not None else asyncio.run
    print(f"{'bytes':>6} {'shape':>6} {'wall_us':>8} {'cpu_us':>7}")
    for size in (int(s) for s in a.sizes.split(",")):
        for shape, (wall, cpu) in run(measure(size, a.rounds)).items():
            print(f"{size:>6} {shape:>6} {wall:>8.0f} {cpu:>7.0f}", flush=True)


if __name__ == "__main__":
    main()
