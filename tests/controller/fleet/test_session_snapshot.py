"""A session's snapshot against its state, without a model or a process: the session runs its
real lifecycle and step loop against a fake executor client (placement, steps, a loss)."""

from __future__ import annotations

import asyncio
import time

import pytest

from common.wire.config import Capabilities, DeviceInfo, KVCacheSpec, MemoryProfile, ModelGeometry
from common.wire.step_types import SamplingParams, StepInput, StepOutput
from controller.core.outputs import GenerationRequest
from controller.core.request import Request
from controller.core.snapshot import ExecutorSnapshot
from controller.fleet.client import ExecutorLost, HandshakeResult
from controller.fleet.session import ExecutorSession
from controller.fleet.tracked import Tracked
from controller.observe.metrics import EngineMetrics
from controller.settings import ControllerConfig
from tests.controller.core.harness import FakeExecutor

ADDRESS = "10.0.0.7:50051"

# --- a session driven by a fake executor ---------------------------------------------------


class FakeClient:
    """Stands in for ExecutorClient: always healthy, a handshake that resets a harness
    FakeExecutor, steps answered in order; `lose_next` breaks the stream at the next result."""

    def __init__(self) -> None:
        self.address = ADDRESS
        self.executor = FakeExecutor()
        self.sent: list[StepInput] = []  # steps not answered yet, oldest first
        self.steps = 0  # steps answered
        self.tokens = 0  # tokens in the steps answered
        self.lose_next = False  # raise ExecutorLost at the next receive_result

    async def check_health(self, timeout: float) -> str:
        return "SERVING"

    async def handshake(self, *args, **kwargs) -> HandshakeResult:
        self.executor, self.sent = FakeExecutor(), []
        info = DeviceInfo(
            "inc-1",
            "cpu",
            "fake-cpu",
            ModelGeometry("m", "Llama", 5000, 1, 1, 1, 4096),
            KVCacheSpec(16, 64, "float32"),
            Capabilities(max_tokens_per_step=256, max_num_seqs=8),
        )
        return HandshakeResult(info, MemoryProfile(0, 0, 0), 64, 0.0)

    async def send_step(self, step: StepInput) -> None:
        self.sent.append(step)

    async def receive_result(self, step: StepInput) -> StepOutput:
        await asyncio.sleep(0.001)  # a measurable step time
        if self.lose_next:
            self.lose_next = False
            raise ExecutorLost("stream broke")
        output = self.executor.run(self.sent.pop(0))
        self.steps += 1
        self.tokens += step.num_scheduled_tokens
        return output

    async def close_stream(self) -> None:
        self.sent.clear()

    async def close(self) -> None:
        self.sent.clear()


class FakeOwner:
    """Records what the session reports; snapshots the session when it hands requests back."""

    def __init__(self) -> None:
        self.session: ExecutorSession | None = None
        self.ready: list[str] = []
        self.removed: list[str] = []
        self.done: list[tuple[str, str | None, str]] = []  # request id, reason, address
        self.moved: list[Tracked] = []
        self.at_loss: ExecutorSnapshot | None = None  # the session's snapshot at relocation

    def check_compatible(self, address: str, info: DeviceInfo) -> None:
        pass

    def cost_prior(self, address: str) -> tuple[float, float] | None:
        return None

    def session_ready(self, address: str) -> None:
        self.ready.append(address)

    def session_removed(self, address: str) -> None:
        self.removed.append(address)

    def request_done(self, tracked: Tracked, reason: str | None, address: str, now: float) -> None:
        self.done.append((tracked.gen.request_id, reason, address))

    def relocate(self, moved: list[Tracked], source: str) -> None:
        assert self.session is not None
        self.moved.extend(moved)
        self.at_loss = self.session.snapshot()


class _NoText:
    """Stands in for the detokenizer: no text, no stop strings."""

    deferred = False

    def update(self, token_ids: list[int], finished: bool) -> tuple[str, bool]:
        return "", False


def _tracked(rid: str, prompt_len: int, max_tokens: int) -> Tracked:
    prompt = [100 + (hash((rid, i)) % 800) for i in range(prompt_len)]
    gen = GenerationRequest(rid, prompt, SamplingParams(), max_tokens=max_tokens, ignore_eos=True)
    return Tracked(
        gen=gen,
        queue=asyncio.Queue(),
        text=_NoText(),
        request=Request(rid, prompt, SamplingParams(), max_tokens=max_tokens, ignore_eos=True),
        arrival=time.perf_counter(),
    )


async def _until(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


def test_snapshot_follows_the_session_through_placement_steps_and_a_loss():
    async def main() -> None:
        owner = FakeOwner()
        config = ControllerConfig(
            model="unused",
            executors=[ADDRESS],
            reconnect_backoff_min=0.01,
            health_check_interval=3600.0,
            max_num_seqs=4,
        )
        session = owner.session = ExecutorSession(owner, config, EngineMetrics("m"), ADDRESS, "dns")
        client = FakeClient()
        session.client = session.health.client = client

        fresh = session.snapshot()
        assert (fresh.address, fresh.source, fresh.state) == (ADDRESS, "dns", "connecting")
        assert (fresh.kind, fresh.device, fresh.incarnation, fresh.incarnations) == (
            None,
            None,
            None,
            0,
        )
        assert not fresh.healthy and not fresh.connected and fresh.block_size == 0
        assert (fresh.overhead, fresh.measured_steps) == (pytest.approx(0.03), 0)

        session.start()
        await _until(lambda: session.healthy, "the handshake")
        up = session.snapshot()
        assert owner.ready == [ADDRESS]
        assert (up.kind, up.device, up.incarnation, up.incarnations) == (
            "cpu",
            "fake-cpu",
            "inc-1",
            1,
        )
        assert (
            up.state == "healthy"
            and up.healthy
            and up.connected
            and up.state_since >= fresh.state_since
        )
        assert (up.num_blocks, up.block_size, up.free_blocks, up.used_blocks) == (64, 16, 63, 0)
        assert (up.max_num_seqs, up.max_num_batched_tokens) == (4, 256)  # settings within caps

        # Two requests placed, before the step loop runs: queued, nothing computed yet.
        a, b = _tracked("a", 40, 3), _tracked("b", 20, 5)
        session.add(a)
        session.add(b)
        assert a.placed_on == ADDRESS and b.placed_on == ADDRESS
        placed = session.snapshot(expected_output=4)
        assert (placed.requests, placed.requests_placed, placed.waiting, placed.running) == (
            2,
            2,
            2,
            0,
        )
        assert placed.uncomputed_tokens == 60
        assert placed.decode_tokens == 3 + 4  # each capped at the expected output
        assert session.snapshot().decode_tokens == 0

        # Steps applied until both finish.
        await _until(lambda: len(owner.done) == 2, "both requests")
        done = session.snapshot()
        assert sorted(owner.done) == [("a", "length", ADDRESS), ("b", "length", ADDRESS)]
        assert a.placed_on is None and (done.requests, done.running, done.waiting) == (0, 0, 0)
        assert (done.used_blocks, done.kv_usage) == (0, 0.0)
        assert (done.steps, done.tokens) == (client.steps, client.tokens) and done.steps >= 5
        assert done.tokens == 40 + 20 + 2 + 4  # prompts, then one token per later output
        assert done.measured_steps == done.steps and done.tokens_per_second > 0
        stats = session.scheduler.stats()
        assert (done.prefix_cache_queries, done.prefix_cache_hits) == (
            stats.prefix_cache_queries,
            stats.prefix_cache_hits,
        )
        assert done.prefix_cache_queries > 0

        # A loss while a request runs: it is handed back detached, the snapshot says why.
        c = _tracked("c", 30, 50)
        client.lose_next = True
        session.add(c)
        await _until(lambda: owner.at_loss is not None, "the loss")
        lost = owner.at_loss
        assert [t.gen.request_id for t in owner.moved] == ["c"] and c.placed_on is None
        assert lost.state == "unhealthy" and not lost.healthy and not lost.connected
        assert (lost.losses, lost.last_loss, lost.requests, lost.running) == (
            1,
            "stream broke",
            0,
            0,
        )
        assert lost.requests_placed == 3 and lost.max_num_seqs == 0
        # The retired scheduler's prefix counters are kept: over every connection.
        assert lost.prefix_cache_queries >= done.prefix_cache_queries

        await _until(lambda: session.healthy, "the reconnect")
        back = session.snapshot()
        assert (back.reconnects, back.losses, back.incarnations) == (1, 1, 1)  # same process
        assert back.connected and back.connect_error == "" and back.used_blocks == 0
        assert back.prefix_cache_queries == lost.prefix_cache_queries
        assert owner.ready == [ADDRESS, ADDRESS]
        await session.stop()
        assert owner.removed == [ADDRESS] and session.snapshot().state == "removed"

    asyncio.run(main())
