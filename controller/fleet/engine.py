"""The engine: the fleet of executors, request placement, failover and output streaming.

Each executor address gets an `ExecutorRunner` (its session, scheduler, block pool and step
loop; see runner.py). Addresses come from discovery (static, DNS, files; see discovery.py) and
may join or leave at any time. Each request is placed on one healthy executor by the placement
policy (placement.py). When an executor is lost, its unfinished requests are placed again on
healthy executors and resumed by recompute (prompt + tokens so far), so a client's stream only
pauses; with no healthy executor they wait up to `no_executor_timeout`, then fail (503). A
request that an executor still has not admitted after `affinity_max_wait` seconds moves to an
executor that can start it at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from common.wire.config import DeviceInfo
from controller.core.kv_cache import hash_token_blocks
from controller.core.outputs import GenerationRequest, OutputDelta
from controller.core.request import Request
from controller.fleet.client import make_security
from controller.fleet.discovery import Discovery
from controller.fleet.placement import PlacementPolicy, PlacementQuery, candidate_of
from controller.fleet.session import ExecutorRunner, RunnerState
from controller.fleet.tracked import Tracked
from controller.observe.metrics import EngineMetrics
from controller.observe.report import executor_report
from controller.settings import ControllerConfig
from controller.text.detokenizer import OutputTextState
from controller.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_MAINTAIN_PERIOD = 0.2  # seconds between passes over waiting and stuck requests


class NoExecutorError(RuntimeError):
    """No healthy executor took the request in time."""


class Engine:
    """Routes requests to a changing fleet of executors and streams their outputs."""

    def __init__(self, config: ControllerConfig, tokenizer: Tokenizer):
        self.config = config  # controller configuration
        self.tokenizer = tokenizer  # for detokenization
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
        self.runners: dict[str, ExecutorRunner] = {}  # by address
        self.max_model_len = config.max_model_len  # the fleet's; set as executors connect
        self.eos_token_ids: list[int] = list(tokenizer.eos_token_ids)  # from tokenizer + model
        self.num_kv_tokens = 0  # smallest executor KV capacity in tokens
        self.waiting: dict[str, Tracked] = {}  # requests waiting for a healthy executor
        self._expected_output = 64.0  # running mean of generated lengths, for placement
        self._reference: DeviceInfo | None = None  # the first executor's model, for checks
        self._kick = asyncio.Event()  # wakes the maintenance loop
        self._tasks: list[asyncio.Task] = []  # discovery and maintenance loops
        self.metrics.watch(self)

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Resolve the executors, connect to them in the background, start the loops."""
        self._apply(await self.discovery.resolve())
        self._tasks.append(asyncio.create_task(self._maintain(), name="maintain"))
        if self.discovery.dynamic:
            self._tasks.append(asyncio.create_task(self._discover(), name="discovery"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(r.stop() for r in list(self.runners.values())))

    async def _discover(self) -> None:
        while True:
            await asyncio.sleep(self.config.discovery_interval)
            try:
                self._apply(await self.discovery.resolve())
            except Exception:  # keep discovering whatever one round did
                log.exception("discovery round failed")

    def _apply(self, found: dict[str, str]) -> None:
        """Start runners for new addresses; drain the ones that left."""
        for address, source in found.items():
            runner = self.runners.get(address)
            if runner is None:
                log.info("executor %s joined (%s)", address, source)
                runner = self.runners[address] = ExecutorRunner(self, address, source)
                runner.start()
            elif runner.leaving and runner.rejoin():
                log.info("executor %s is back in discovery", address)
        for address, runner in list(self.runners.items()):
            if address not in found:
                runner.leave()

    # --- callbacks from runners --------------------------------------------------------

    def runner_ready(self, runner: ExecutorRunner) -> None:
        """A handshake finished: adopt its limits, place waiting requests."""
        self._refresh_limits()
        self._kick.set()

    def runner_removed(self, runner: ExecutorRunner) -> None:
        if self.runners.get(runner.address) is runner:
            del self.runners[runner.address]
            log.info("executor %s removed", runner.address)
        self._refresh_limits()

    def request_done(
        self, tracked: Tracked, reason: str | None, runner: ExecutorRunner, now: float
    ) -> None:
        """A request finished on an executor: metrics, the expected output length, a log line."""
        self.metrics.request_finished(reason, tracked, now, runner)
        req = tracked.request
        if req is None:
            return
        self._expected_output = 0.9 * self._expected_output + 0.1 * req.num_output_tokens
        log.info(
            "request %s finished (%s) on %s: %d prompt tokens (%d cached), %d generated, %.2fs",
            tracked.gen.request_id,
            reason,
            runner.address,
            req.num_prompt_tokens,
            req.num_cached_tokens,
            req.num_output_tokens,
            now - tracked.arrival,
        )

    def check_compatible(self, runner: ExecutorRunner, info: DeviceInfo) -> None:
        """Refuse an executor that serves a different model than the fleet."""
        ref = self._reference
        if ref is None:
            self._reference = info
            return
        mine = (info.model.architecture, info.model.vocab_size, info.model.num_layers)
        theirs = (ref.model.architecture, ref.model.vocab_size, ref.model.num_layers)
        if mine != theirs:
            raise RuntimeError(
                f"executor {runner.address} serves a different model {mine}; "
                f"the fleet serves {theirs}"
            )

    def fleet_cost_prior(self, runner: ExecutorRunner) -> tuple[float, float]:
        """Starting step-cost guess for a new executor: the fleet's average."""
        fitted = [
            r.cost.coefficients()
            for r in self.runners.values()
            if r is not runner and r.cost.steps > 0
        ]
        if not fitted:
            return runner.cost.prior_overhead, runner.cost.prior_per_token
        return (sum(f[0] for f in fitted) / len(fitted), sum(f[1] for f in fitted) / len(fitted))

    def _refresh_limits(self) -> None:
        known = [
            r
            for r in self.runners.values()
            if r.info is not None and r.state is not RunnerState.REMOVED
        ]
        if not known:
            return  # keep the last fleet's limits while none is connected
        self.max_model_len = min(r.info.model.max_model_len for r in known)
        self.num_kv_tokens = min((r.num_blocks - 1) * r.block_size for r in known)
        for r in known:
            for eos in r.info.model.eos_token_ids:
                if eos not in self.eos_token_ids:
                    self.eos_token_ids.append(eos)

    # --- fleet state -------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """Whether some executor takes work."""
        return any(r.healthy for r in self.runners.values())

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
        n = len(self.runners)
        healthy = sum(r.healthy for r in self.runners.values())
        return f"{healthy} of {n} executor{'s' if n != 1 else ''} healthy"

    def no_executor_message(self) -> str:
        return (
            f"No healthy executor is available: waited {self.config.no_executor_timeout:g}s "
            f"for one ({self.fleet_summary()}). Try again later."
        )

    def executors_state(self) -> list[dict]:
        """Per-executor state for /health and the admin endpoint."""
        return [executor_report(r) for r in self.runners.values()]

    # --- requests ----------------------------------------------------------------------

    def make_request(self, gen: GenerationRequest, output_so_far: list[int] | None = None):
        """The scheduler's Request for a generation request (resumed: with its output)."""
        req = Request(
            request_id=gen.request_id,
            prompt_token_ids=gen.prompt_token_ids,
            sampling=gen.sampling,
            max_tokens=gen.max_tokens,
            eos_token_ids=self.eos_token_ids,
            stop_token_ids=gen.stop_token_ids,
            ignore_eos=gen.ignore_eos,
            min_tokens=gen.min_tokens,
            priority=gen.priority,
            max_model_len=self.max_model_len,
        )
        if output_so_far:
            req.output_token_ids = list(output_so_far)
        return req

    async def generate(self, gen: GenerationRequest) -> AsyncIterator[OutputDelta]:
        """Run one request; yields its deltas; aborts it if the consumer goes away.

        Raises NoExecutorError when no healthy executor takes it within the timeout.
        """
        tracked = Tracked(
            gen=gen,
            queue=asyncio.Queue(),
            text=OutputTextState(
                self.tokenizer,
                gen.prompt_token_ids,
                stop=gen.stop,
                include_stop_str_in_output=gen.include_stop_str_in_output,
                skip_special_tokens=gen.skip_special_tokens,
                defer=not gen.stream,
            ),
            request=None,
            arrival=time.perf_counter(),
        )
        if not self._place(tracked):
            self._wait(tracked)
        finished = False
        try:
            while not finished:
                item = await tracked.queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._abort(tracked)

    def _abort(self, tracked: Tracked) -> None:
        if tracked.runner is not None:
            tracked.runner.abort(tracked)
        elif self.waiting.pop(tracked.gen.request_id, None) is not None:
            self.metrics.request_finished("abort", tracked)

    def _place(
        self, tracked: Tracked, exclude: ExecutorRunner | None = None, startable_only: bool = False
    ) -> bool:
        """Place a request on the best healthy executor; False when none can take it."""
        gen = tracked.gen
        output = tracked.output_token_ids
        tokens = gen.prompt_token_ids + output
        n = len(tokens)
        longest = len(gen.prompt_token_ids) + gen.max_tokens
        runners = [
            r
            for r in self.runners.values()
            if r.healthy
            and r is not exclude
            and r.fits(n, longest)
            and (not startable_only or r.can_start_now(n))
        ]
        if not runners:
            return False
        use_cache = self.config.enable_prefix_caching and gen.sampling.prompt_logprobs is None
        hashes: dict[int, list[bytes]] = {}
        for r in runners:
            if r.block_size not in hashes:
                hashes[r.block_size] = hash_token_blocks(tokens, r.block_size) if use_cache else []
        remaining = max(gen.max_tokens - len(output), 1)
        expected = self._expected_output
        healthy = [r for r in self.runners.values() if r.healthy]
        query = PlacementQuery(
            n,
            max(1, min(remaining, round(expected))),
            reference_batch=1.0 + sum(len(r.tracked) for r in healthy) / max(len(healthy), 1),
        )
        decision = self.policy.choose(
            query, [candidate_of(r, hashes[r.block_size], n, expected) for r in runners]
        )
        assert decision is not None
        runner = self.runners[decision.key]
        request = self.make_request(gen, output)
        request.arrival_time = tracked.arrival_time
        request.block_hashes = list(hashes[runner.block_size])
        tracked.request = request
        tracked.queued_hashes = hashes[runner.block_size]
        tracked.expected_hit = decision.prefix_hit
        runner.add(tracked)  # ValueError (never runnable) goes to the caller
        self.metrics.placed(decision.reason)
        log.debug(
            "request %s -> %s (%s, %d cached tokens, latency %.2fs, balanced %.2fs)",
            gen.request_id,
            runner.address,
            decision.reason,
            decision.prefix_hit,
            decision.latency,
            decision.balance_latency,
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
        )

    def relocate(self, moved: list[Tracked], source: ExecutorRunner, failover: bool) -> None:
        """Place requests taken from `source` elsewhere; they resume by recompute."""
        now = time.perf_counter()
        for tracked in moved:
            tracked.num_moves += 1
            tracked.prompt_logprobs_skip = tracked.prompt_logprobs_sent
            if failover:
                tracked.lost_at = tracked.lost_at or now
                self.metrics.failed_over(source)
            try:
                placed = self._place(tracked, exclude=source)
            except ValueError as exc:
                self._fail(tracked, RuntimeError(f"request cannot be resumed: {exc}"))
                continue
            if not placed:
                self._wait(tracked)
        if failover:
            log.info(
                "failover from %s: %d requests moved, %d waiting for an executor",
                source.address,
                len(moved),
                len(self.waiting),
            )

    def _fail(self, tracked: Tracked, error: Exception) -> None:
        tracked.queue.put_nowait(error)
        self.metrics.request_finished("error", tracked)

    # --- maintenance: waiting requests and the affinity bound --------------------------

    async def _maintain(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._kick.wait(), timeout=_MAINTAIN_PERIOD)
            except TimeoutError:
                pass
            self._kick.clear()
            try:
                self._place_waiting()
                self._rebalance()
            except Exception:  # never let one bad pass stop the loop
                log.exception("maintenance pass failed")

    def _place_waiting(self) -> None:
        if not self.waiting:
            return
        now = time.monotonic()
        for rid, tracked in sorted(self.waiting.items(), key=lambda kv: kv[1].waiting_since):
            try:
                placed = self._place(tracked)
            except ValueError as exc:
                del self.waiting[rid]
                self._fail(tracked, RuntimeError(f"request cannot run: {exc}"))
                continue
            if placed:
                del self.waiting[rid]
            elif now - tracked.waiting_since >= self.config.no_executor_timeout:
                del self.waiting[rid]
                log.warning(
                    "request %s failed: no healthy executor for %.0fs",
                    rid,
                    now - tracked.waiting_since,
                )
                self._fail(tracked, NoExecutorError(self.no_executor_message()))

    def _rebalance(self) -> None:
        """Move requests an executor has held unadmitted past the bound to one that can
        start them now (so affinity, or a stale estimate, never holds a request back long),
        and every unadmitted request off a draining executor."""
        healthy = [r for r in self.runners.values() if r.healthy]
        for runner in self.runners.values():
            if runner.state is RunnerState.DRAINING and healthy:
                for tracked in runner.stale_waiting(float("inf")):
                    runner.withdraw(tracked)
                    self.metrics.rebalanced()
                    if not self._place(tracked):
                        self._wait(tracked)
        if len(healthy) < 2:
            return
        cutoff = time.monotonic() - self.config.affinity_max_wait
        for runner in healthy:
            for tracked in runner.stale_waiting(cutoff):
                n = tracked.request.num_tokens if tracked.request else 0
                if not any(o is not runner and o.can_start_now(n) for o in healthy):
                    break
                runner.withdraw(tracked)
                tracked.num_moves += 1
                self.metrics.rebalanced()
                if not self._place(tracked, exclude=runner, startable_only=True):
                    if not self._place(tracked):
                        self._wait(tracked)
