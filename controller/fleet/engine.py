"""The engine: the fleet of executors, request placement, failover and output streaming.

Each executor address gets an `ExecutorSession` (its connection, scheduler, block pool and
step loop; see session.py), which reports back through the `SessionOwner` interface the engine
implements (owner.py). Addresses come from discovery (static, DNS, files; see discovery.py) and
may join or leave at any time; with other controllers (peers.py), the live ones divide the
executors between them and this one drives only its share (membership.py). Each request is
placed on one healthy executor by the placement policy (placement.py). When an executor is
lost, its unfinished requests are placed again on healthy executors and resumed by recompute
(prompt + tokens so far), so a client's stream only pauses; with no healthy executor they wait
up to `no_executor_timeout`, then fail (503). A request that an executor still has not admitted
after `affinity_max_wait` seconds moves to an executor that can start it at once.

A request fails alone, with an error to its client, when it cannot run: data that cannot be
put on the wire (checked before it is placed), a scheduler that can never run it, or more
than `max_request_moves` moves off lost executors (it may be what takes them down).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from common.wire.config import DeviceInfo
from common.wire.convert import new_request_wire_problem
from common.wire.step_types import NewRequestData
from controller.core.kv_cache import hash_token_blocks
from controller.core.outputs import GenerationRequest, OutputDelta
from controller.core.snapshot import ExecutorSnapshot
from controller.fleet.channel_security import make_security
from controller.fleet.discovery import Discovery
from controller.fleet.fleet_model import FleetModel
from controller.fleet.incarnations import Incarnations
from controller.fleet.maintenance import Maintenance
from controller.fleet.membership import Membership
from controller.fleet.ownership import new_owner_id
from controller.fleet.peers import Peers
from controller.fleet.placement import (
    PlacementPolicy,
    PlacementQuery,
    candidate_of,
    mean_step_cost,
)
from controller.fleet.session import ExecutorSession, SessionState
from controller.fleet.tracked import (
    DeltaSink,
    Tracked,
    count_finished,
    deliver,
    error_delta,
    scheduler_request,
    track,
)
from controller.observe.fleet_collector import FleetCollector
from controller.observe.metrics import EngineMetrics
from controller.observe.report import executor_report
from controller.settings import ControllerConfig
from controller.text.detokenizer import prepare_detokenizers
from controller.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class NoExecutorError(RuntimeError):
    """No healthy executor took the request in time."""


class Engine(Maintenance, Membership):
    """Routes requests to a changing fleet of executors and streams their outputs (its
    maintenance loop: `Maintenance`, maintenance.py; its sessions as discovery and the
    division between controllers make them: `Membership`, membership.py)."""

    def __init__(self, config: ControllerConfig, tokenizer: Tokenizer):
        self.config = config  # controller configuration
        self.tokenizer = tokenizer  # for detokenization
        prepare_detokenizers(tokenizer)  # its tables, before the first request needs them
        self.metrics = EngineMetrics(config.served_model_name)  # Prometheus metrics
        self.executor_security = make_security(  # TLS and token of every executor channel
            config.executor_tls_ca,
            config.executor_tls_cert,
            config.executor_tls_key,
            config.executor_tls_server_name,
            config.executor_token,
        )
        self.policy = PlacementPolicy(config.prefix_affinity, config.affinity_max_wait)
        self.discovery = Discovery(config)  # where executors are
        self.sessions: dict[str, ExecutorSession] = {}  # by address
        self.owner_id = new_owner_id()  # this controller process, as executors know it
        self.peers = Peers(config, self.owner_id, self._divide)  # the other controllers
        self.model = FleetModel(config.max_model_len, tokenizer.eos_token_ids)  # its limits
        self.waiting: dict[str, Tracked] = {}  # requests waiting for a healthy executor
        self._incarnations = Incarnations(lambda address: address in self.sessions)
        self._expected_output = 64.0  # running mean of generated lengths, for placement
        self._kick = asyncio.Event()  # wakes the maintenance loop
        self._tasks: list[asyncio.Task] = []  # discovery and maintenance loops
        self.metrics.registry.register(  # the fleet's gauges, read at scrape time
            FleetCollector(self._read_fleet, config.served_model_name, config.enable_prefix_caching)
        )

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Probe the peers once, resolve the executors, connect to this controller's share of
        them in the background, start the loops."""
        await self.peers.start()
        self._apply(await self.discovery.resolve())
        self._tasks.append(asyncio.create_task(self._maintain(), name="maintain"))
        if self.discovery.dynamic:
            self._tasks.append(asyncio.create_task(self._discover(), name="discovery"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.peers.stop()
        await asyncio.gather(*(s.stop() for s in list(self.sessions.values())))

    # --- SessionOwner: what sessions report ----------------------------------------------

    def session_ready(self, address: str) -> None:
        """A handshake finished: adopt its limits, place waiting requests."""
        self._refresh_limits()
        self._kick.set()

    def session_removed(self, address: str) -> None:
        """The session ended for good: forget it, and its metric series."""
        session = self.sessions.get(address)
        if session is not None and session.state is SessionState.REMOVED:
            del self.sessions[address]
            self.metrics.remove_executor(address)
            log.info("executor %s removed", address)
        self._refresh_limits()

    def claim_incarnation(self, address: str, incarnation: str) -> str:
        """One session per executor process: the address already driving `incarnation`
        (another live session), or "" once the session at `address` holds the claim."""
        return self._incarnations.claim(address, incarnation)

    def release_incarnation(self, address: str) -> None:
        self._incarnations.release(address)

    def request_done(self, tracked: Tracked, reason: str | None, address: str, now: float) -> None:
        """A request finished on an executor: the expected output length, a log line."""
        req = tracked.request
        if req is None:
            return
        self._expected_output = 0.9 * self._expected_output + 0.1 * req.num_output_tokens
        log.info(
            "request %s finished (%s) on %s: %d prompt tokens (%d cached), %d generated, %.2fs",
            tracked.gen.request_id,
            reason,
            address,
            req.num_prompt_tokens,
            req.num_cached_tokens,
            req.num_output_tokens,
            now - tracked.stats.arrival,
            extra=tracked.log_extra,
        )

    def check_compatible(self, address: str, info: DeviceInfo) -> None:
        """Refuse an executor that serves a different model than the fleet."""
        self.model.check_compatible(address, info)

    def cost_prior(self, address: str) -> tuple[float, float] | None:
        """Starting step-cost guess for a new executor: the fleet's average (None: no executor
        measured yet, keep the default)."""
        return mean_step_cost(s.snapshot() for a, s in self.sessions.items() if a != address)

    def _refresh_limits(self) -> None:
        self.model.refresh(
            [s for s in self.sessions.values() if s.state is not SessionState.REMOVED]
        )

    @property
    def max_model_len(self) -> int:
        """The fleet's context length: the least of its executors'."""
        return self.model.max_model_len

    @property
    def num_kv_tokens(self) -> int:
        """The smallest executor's KV capacity in tokens."""
        return self.model.num_kv_tokens

    @property
    def eos_token_ids(self) -> list[int]:
        """Every token that ends a sequence: the tokenizer's and every executor's."""
        return self.model.eos_token_ids

    # --- fleet state -------------------------------------------------------------------

    def _read_fleet(self) -> tuple[list[ExecutorSnapshot], int]:
        """The fleet for the scrape-time gauges: a snapshot per executor, and the requests
        waiting for one."""
        return [s.snapshot() for s in list(self.sessions.values())], len(self.waiting)

    @property
    def healthy(self) -> bool:
        """Whether some executor takes work."""
        return any(s.healthy for s in self.sessions.values())

    async def wait_for_executor(self, timeout: float | None = None) -> bool:
        """Wait (up to `no_executor_timeout`) until some executor is healthy."""
        limit = self.config.no_executor_timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while not self.healthy:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    def fleet_summary(self) -> str:
        n = len(self.sessions)
        healthy = sum(s.healthy for s in self.sessions.values())
        return f"{healthy} of {n} executor{'s' if n != 1 else ''} healthy"

    def no_executor_message(self) -> str:
        return (
            f"No healthy executor is available: waited {self.config.no_executor_timeout:g}s "
            f"for one ({self.fleet_summary()}). Try again later."
        )

    def executors_state(self) -> list[dict]:
        """Per-executor state for /health and the admin endpoint."""
        return [executor_report(s.snapshot()) for s in self.sessions.values()]

    # --- requests ----------------------------------------------------------------------

    async def generate(self, gen: GenerationRequest) -> AsyncIterator[OutputDelta]:
        """Run one request; yields its deltas; aborts it if the consumer goes away.

        Raises NoExecutorError when no healthy executor takes it within the timeout; a request
        that cannot run ends with an error delta.
        """
        queue: asyncio.Queue = asyncio.Queue()
        tracked = self.submit(gen, queue)
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(tracked)

    def submit(self, gen: GenerationRequest, sink: DeltaSink) -> Tracked:
        """Start one request whose deltas (or a NoExecutorError) the step loops put on `sink`
        as they make them: no task of its own, no queue between the step and the response's
        writer. The caller aborts it (`abort`) if it stops reading before the last delta."""
        tracked = track(gen, self.tokenizer, sink)
        problem = new_request_wire_problem(
            NewRequestData(gen.request_id, gen.prompt_token_ids, [], gen.sampling, [], 0, 0)
        )
        if problem:  # it would fail the step it joins: it fails alone, before any executor
            self._fail_alone(tracked, problem)
        else:
            self._place_or_wait(tracked)
        return tracked

    def abort(self, tracked: Tracked, reason: str = "abort") -> None:
        """End a request its reader gave up on (its blocks go back; `reason` "stop": a stream
        writer found a stop string); nothing if it is over."""
        session = self.sessions.get(tracked.placed_on) if tracked.placed_on else None
        if session is not None:
            session.abort(tracked, reason)
        elif self.waiting.pop(tracked.gen.request_id, None) is not None:
            count_finished(self.metrics, reason, tracked)

    def _place_or_fail(
        self, tracked: Tracked, exclude: str | None = None, startable_only: bool = False
    ) -> bool:
        """``_place``, failing the request alone when no scheduler can ever run it (then True:
        it is taken care of)."""
        try:
            return self._place(tracked, exclude, startable_only)
        except ValueError as exc:
            self._fail_alone(tracked, f"the request cannot run: {exc}")
            return True

    def _place_or_wait(self, tracked: Tracked) -> None:
        """Place a request, or fail it alone, or let it wait for an executor."""
        if not self._place_or_fail(tracked):
            self._wait(tracked)

    def _place(
        self, tracked: Tracked, exclude: str | None = None, startable_only: bool = False
    ) -> bool:
        """Place a request on the best healthy executor (not the one at `exclude`); False when
        none can take it."""
        gen = tracked.gen
        output = tracked.output_token_ids
        tokens = gen.prompt_token_ids + output
        n = len(tokens)
        longest = len(gen.prompt_token_ids) + gen.max_tokens
        healthy = [s for s in self.sessions.values() if s.healthy]
        eligible = [
            s
            for s in healthy
            if s.address != exclude
            and s.fits(n, longest)
            and (not startable_only or s.can_start_now(n))
        ]
        if not eligible:
            return False
        use_cache = self.config.enable_prefix_caching and gen.sampling.prompt_logprobs is None
        hashes: dict[int, list[bytes]] = {}
        for s in eligible:
            if s.block_size not in hashes:
                hashes[s.block_size] = hash_token_blocks(tokens, s.block_size) if use_cache else []
        remaining = max(gen.max_tokens - len(output), 1)
        expected = self._expected_output
        query = PlacementQuery(
            n,
            max(1, min(remaining, round(expected))),
            reference_batch=1.0 + sum(len(s.tracked) for s in healthy) / max(len(healthy), 1),
        )
        candidates = [
            candidate_of(s.snapshot(expected), s.prefix_hit(hashes[s.block_size], n))
            for s in eligible
        ]
        decision = self.policy.choose(query, candidates)
        assert decision is not None
        session = self.sessions[decision.key]
        request = scheduler_request(gen, output, self.eos_token_ids, self.max_model_len)
        request.arrival_time = tracked.arrival_time
        request.block_hashes = list(hashes[session.block_size])
        tracked.request = request
        tracked.queued_hashes = hashes[session.block_size]
        tracked.expected_hit = decision.prefix_hit
        session.add(tracked)  # ValueError (never runnable) goes to the caller
        self.metrics.placed(decision.reason)
        log.debug(
            "request %s -> %s (%s, %d cached tokens, latency %.2fs, balanced %.2fs)",
            gen.request_id,
            session.address,
            decision.reason,
            decision.prefix_hit,
            decision.latency,
            decision.balance_latency,
            extra=tracked.log_extra,
        )
        return True

    def _wait(self, tracked: Tracked) -> None:
        """No executor can take the request now: hold it until one can (or time out)."""
        tracked.waiting_since = time.monotonic()
        self.waiting[tracked.gen.request_id] = tracked
        log.info(
            "request %s waits for a healthy executor (%s)",
            tracked.gen.request_id,
            self.fleet_summary(),
            extra=tracked.log_extra,
        )

    def _fail_waiting(self, tracked: Tracked) -> None:
        """A waiting request found no healthy executor in time: NoExecutorError (a 503)."""
        tracked.queue.put_nowait(NoExecutorError(self.no_executor_message()))
        count_finished(self.metrics, "error", tracked)

    def _fail_alone(self, tracked: Tracked, error: str) -> None:
        """End a request on no executor with an error to its client (a 500 there)."""
        log.warning("request %s failed: %s", tracked.gen.request_id, error, extra=tracked.log_extra)
        deliver(tracked, error_delta(tracked, error))
        count_finished(self.metrics, "error", tracked)
