"""Holding an admitted request until the fleet has a healthy executor (serving.py, stage 4):
it ends when an executor is healthy, the client leaves, the controller shuts down, or the
fleet's `--no-executor-timeout` passes."""

from __future__ import annotations

import asyncio

from fastapi import Request as HTTPRequest

from controller.api.deltas import DeltaQueue
from controller.api.errors import APIError
from controller.api.streaming import client_gone
from controller.fleet.engine import Engine


async def wait_for_executor(engine: Engine, queue: DeltaQueue, http: HTTPRequest) -> bool:
    """Hold an admitted request until some executor is healthy: False when its client
    left first; 503 after the fleet's timeout, or when the controller shuts down."""
    if engine.healthy:
        return True
    waits = {
        "executor": asyncio.ensure_future(engine.wait_for_executor()),
        "gone": asyncio.ensure_future(client_gone(http)),
        "abort": asyncio.ensure_future(queue.wait_aborted()),
    }
    try:
        await asyncio.wait(waits.values(), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits.values():
            task.cancel()
        await asyncio.gather(*waits.values(), return_exceptions=True)
    found = waits["executor"]
    if found.done() and not found.cancelled() and found.result():
        return True
    if waits["abort"].done() and not waits["abort"].cancelled():
        raise APIError(
            "The server is shutting down; retry on another replica.", 503, code="shutting_down"
        )
    if waits["gone"].done() and not waits["gone"].cancelled():
        return False
    raise APIError(engine.no_executor_message(), 503, code="no_healthy_executor")
