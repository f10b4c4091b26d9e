"""The part of the engine the API layer needs, without executors: tests of the HTTP layer
subclass `FakeEngineBase` and write `generate` (what the "model" answers)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from prometheus_client import CollectorRegistry


class FakeEngineBase:
    """An engine with one healthy pretend executor; `gens` records what it was asked."""

    def __init__(self, eos_token_ids: list[int], max_model_len: int = 4096, **config):
        self.config = SimpleNamespace(model="fake", **config)
        self.max_model_len = self.num_kv_tokens = max_model_len
        self.eos_token_ids = list(eos_token_ids)
        self.healthy = True
        self.metrics = SimpleNamespace(registry=CollectorRegistry())
        self.gens: list = []  # the GenerationRequests generate() got, in order

    def submit(self, gen, sink) -> asyncio.Task:
        """`Engine.submit` over a subclass's `generate`: a task puts its deltas on `sink`."""

        async def pump() -> None:
            try:
                async for delta in self.generate(gen):
                    sink.put_nowait(delta)
            except Exception as exc:  # the response raises it, as with the real engine
                sink.put_nowait(exc)

        return asyncio.get_running_loop().create_task(pump())

    def abort(self, handle: asyncio.Task) -> None:
        """`Engine.abort`: stop the request's task."""
        handle.cancel()

    async def generate(self, gen):
        raise NotImplementedError
        yield  # an async generator

    def executors_state(self) -> list[dict]:
        return []

    def fleet_summary(self) -> str:
        return "fake"

    async def wait_for_executor(self) -> bool:
        return True

    def peer_state(self) -> dict:
        """What /peer answers (the engine's Membership.peer_state)."""
        return {"address": "fake:8000", "owner": "host/fake", "owned_executors": 1}
