"""Fakes for executor-session tests without a model or a process: a client answering steps
from a harness FakeExecutor, an owner recording what the session reports, requests with no
detokenizer."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from common.wire import convert
from common.wire.config import Capabilities, DeviceInfo, KVCacheSpec, MemoryProfile, ModelGeometry
from common.wire.step_types import RequestStepOutput, SamplingParams, StepInput, StepOutput
from controller.core.outputs import GenerationRequest
from controller.core.request import Request
from controller.core.snapshot import ExecutorSnapshot
from controller.fleet.client import ExecutorLost, HandshakeResult, StepNotSendable
from controller.fleet.session import ExecutorSession
from controller.fleet.tracked import Tracked
from controller.observe.metrics import EngineMetrics
from controller.settings import ControllerConfig
from tests.controller.core.harness import FakeExecutor


class LenientExecutor(FakeExecutor):
    """A FakeExecutor that behaves as real executors do with what they cannot run: finished ids
    it never held are ignored, a step left with no request is answered, a failed request's
    state is dropped and its later steps answered "unknown request"."""

    def run(self, step: StepInput) -> StepOutput:
        known = [rid for rid in step.finished_request_ids if rid in self.held]
        unknown = [r.request_id for r in step.cached_requests if r.request_id not in self.held]
        step = replace(
            step,
            finished_request_ids=known,
            cached_requests=[r for r in step.cached_requests if r.request_id in self.held],
        )
        if step.num_requests:
            output = super().run(step)
        else:
            assert step.step_id == self.last_step_id + 1
            self.last_step_id = step.step_id
            for rid in known:
                del self.held[rid]
            output = StepOutput(step.step_id)
        for out in output.outputs:
            if out.error:
                self.held.pop(out.request_id, None)
        output.outputs += [RequestStepOutput(rid, error="unknown request") for rid in unknown]
        return output


ADDRESS = "10.0.0.7:50051"

# --- a session driven by a fake executor ---------------------------------------------------


class FakeClient:
    """Stands in for ExecutorClient: always healthy, a handshake that resets a harness
    FakeExecutor, steps answered in order; `lose_next` breaks the stream at the next result."""

    def __init__(self, executor_class: type[FakeExecutor] = FakeExecutor) -> None:
        self.address = ADDRESS
        self.executor_class = executor_class  # what each handshake starts afresh
        self.executor = executor_class()
        self.sent: list[StepInput] = []  # steps not answered yet, oldest first
        self.steps = 0  # steps answered
        self.tokens = 0  # tokens in the steps answered
        self.lose_next = False  # raise ExecutorLost at the next receive_result
        self.all_sent: list[StepInput] = []  # every step sent, answered or not
        self.owner_id = ""  # ownerless sessions: no lease to renew or release
        self.generation = 0
        self.granted_seconds = 0.0
        self.step_port = 0  # the handshake's step socket port (none: steps as over gRPC)
        self.step_transport = "grpc"  # as ExecutorClient.step_transport

    async def check_health(self, timeout: float) -> str:
        return "SERVING"

    async def identify(self, timeout: float) -> str:
        return "inc-1"

    async def handshake(self, *args, **kwargs) -> HandshakeResult:
        self.executor, self.sent = self.executor_class(), []
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
        try:  # as the real client: a step that cannot be converted is not sent
            convert.step_to_pb(step)
        except convert.CONVERSION_ERRORS as exc:
            raise StepNotSendable(str(exc)) from exc
        self.sent.append(step)
        self.all_sent.append(step)

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

    async def release_session(self, timeout: float) -> bool:
        return False


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

    def claim_incarnation(self, address: str, incarnation: str) -> str:
        return ""

    def release_incarnation(self, address: str) -> None:
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


def fake_session(
    owner: FakeOwner, client: FakeClient, max_num_seqs: int, source: str = "static"
) -> ExecutorSession:
    """A session at ADDRESS reporting to `owner` and talking to `client`, not started yet:
    quick reconnects, and no health check before the test's end."""
    config = ControllerConfig(
        model="unused",
        executors=[ADDRESS],
        reconnect_backoff_min=0.01,
        health_check_interval=3600.0,
        max_num_seqs=max_num_seqs,
    )
    session = owner.session = ExecutorSession(owner, config, EngineMetrics("m"), ADDRESS, source)
    session.client = session.health.client = client
    return session


class NoText:
    """Stands in for the detokenizer: no text, no stop strings."""

    deferred = False

    def update(self, token_ids: list[int], finished: bool) -> tuple[str, bool]:
        return "", False


def tracked_request(
    rid: str, prompt_len: int, max_tokens: int, sampling: SamplingParams | None = None
) -> Tracked:
    """A placed-ready request with a fake prompt and no detokenizer."""
    sampling = sampling or SamplingParams()
    prompt = [100 + (hash((rid, i)) % 800) for i in range(prompt_len)]
    gen = GenerationRequest(rid, prompt, sampling, max_tokens=max_tokens, ignore_eos=True)
    return Tracked(
        gen=gen,
        queue=asyncio.Queue(),
        text=NoText(),
        request=Request(rid, prompt, sampling, max_tokens=max_tokens, ignore_eos=True),
        arrival=time.perf_counter(),
    )


async def until(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)
