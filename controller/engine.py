"""The engine: one step loop per executor, request routing, and output processing.

Each executor gets an `ExecutorRunner`: its gRPC client, its own scheduler and block pool
(blocks live on that device), and an asyncio task that schedules a step, sends it, applies the
result and streams text deltas to the waiting API handlers. When an executor is lost, its
unfinished requests are resumed by recompute once it is back (prompt + tokens so far), so no
request is lost and a greedy stream continues exactly as it would have.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from common.config import DeviceInfo
from controller.config import ControllerConfig
from controller.detokenizer import OutputTextState
from controller.executor_client import ExecutorClient, ExecutorLost
from controller.metrics import EngineMetrics
from controller.outputs import GenerationRequest, OutputDelta
from controller.request import Request
from controller.scheduler import (
    Scheduler,
    SchedulerBase,
    SchedulerConfig,
    load_scheduler_class,
)
from controller.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class NoExecutorError(RuntimeError):
    """No executor is available to take a request."""


@dataclass
class _Tracked:
    """Engine-side state of one generation request."""

    gen: GenerationRequest  # what the API asked for
    queue: asyncio.Queue  # OutputDelta items for the API handler
    text: OutputTextState  # incremental detokenizer + stop strings
    request: Request  # the scheduler's request (replaced when resumed elsewhere)
    arrival: float  # perf_counter at arrival
    first_token_at: float = 0.0  # perf_counter of the first token
    last_token_at: float = 0.0  # perf_counter of the latest token
    prompt_logprobs_sent: int = 0  # prompt positions already streamed
    prompt_logprobs_skip: int = 0  # positions a resumed request recomputes and must not resend


class ExecutorRunner:
    """One executor: client, scheduler and the step loop that drives it."""

    def __init__(self, engine: Engine, address: str):
        self.engine = engine  # the owning engine
        self.address = address  # host:port
        self.client = ExecutorClient(address, engine.config.step_timeout)
        self.scheduler: SchedulerBase | None = None  # built after the handshake
        self.info: DeviceInfo | None = None  # InitDevice's answer
        self.num_blocks = 0  # KV blocks on the device
        self.healthy = False  # takes new work only when True
        self.tracked: dict[str, _Tracked] = {}  # requests placed here
        self._wake = asyncio.Event()  # set when work arrives
        self._task: asyncio.Task | None = None  # the step loop

    # --- lifecycle ---------------------------------------------------------------------

    async def connect(self, timeout: float) -> None:
        """Wait for the executor, run the handshake and build a fresh scheduler."""
        cfg = self.engine.config
        await self.client.wait_ready(timeout)
        hs = await self.client.handshake(
            cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_model_len, cfg.seed,
            cfg.num_kv_blocks,
        )
        caps = hs.info.capabilities
        sched_cfg = SchedulerConfig(
            max_num_batched_tokens=min(cfg.max_num_batched_tokens, caps.max_tokens_per_step),
            max_num_seqs=min(cfg.max_num_seqs, caps.max_num_seqs),
            long_prefill_token_threshold=cfg.long_prefill_token_threshold,
            policy=cfg.policy,
            enable_prefix_caching=cfg.enable_prefix_caching,
            chunked_prefill=caps.chunked_prefill,
            block_size=hs.info.kv_cache.block_size,
            num_blocks=hs.num_blocks,
            max_model_len=hs.info.model.max_model_len,
        )
        cls = load_scheduler_class(cfg.scheduler_class) if cfg.scheduler_class else Scheduler
        self.scheduler = cls(sched_cfg)
        self.info, self.num_blocks = hs.info, hs.num_blocks
        self.healthy = True
        log.info(
            "executor %s: %s (%s), %d KV blocks of %d tokens, warm-up %.1fs",
            self.address, hs.info.device_kind, hs.info.device_name, hs.num_blocks,
            hs.info.kv_cache.block_size, hs.warmup_seconds,
        )

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=f"steps-{self.address}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.client.close()

    # --- requests ----------------------------------------------------------------------

    @property
    def load(self) -> int:
        """Requests placed here (running or waiting)."""
        return len(self.tracked)

    def add(self, tracked: _Tracked) -> None:
        assert self.scheduler is not None
        self.tracked[tracked.gen.request_id] = tracked
        self.scheduler.add_request(tracked.request)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        """The client went away: finish the request and free its blocks."""
        if self.tracked.pop(request_id, None) is not None and self.scheduler is not None:
            self.scheduler.finish_requests([request_id], "abort")
            log.info("request %s aborted (client gone)", request_id)
            self.engine.metrics.request_finished("abort")
            self._wake.set()

    # --- the step loop -----------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            try:
                await self._run_steps()
            except ExecutorLost as exc:
                log.warning("executor %s lost: %s", self.address, exc)
                self.engine.metrics.executor_lost()
                await self._recover()

    async def _run_steps(self) -> None:
        while True:
            sched = self.scheduler
            assert sched is not None
            if not sched.has_unfinished_requests():
                self._wake.clear()
                await self._wake.wait()
                continue
            step = sched.schedule()
            if step.num_requests == 0:
                # Nothing fits now (e.g. waiting for blocks); let other tasks run.
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=0.05)
                except TimeoutError:
                    pass
                continue
            started = time.perf_counter()
            output = await self.client.step(step)
            updates = sched.update_from_output(step, output)
            now = time.perf_counter()
            for update in updates:
                self._emit(update, now)
            self.engine.metrics.step_done(
                self, step.num_scheduled_tokens, now - started, sched.stats()
            )

    def _emit(self, update, now: float) -> None:
        tracked = self.tracked.get(update.request_id)
        if tracked is None:
            return
        finished, reason = update.finished, update.finish_reason
        delta, stopped = tracked.text.update(update.new_token_ids, finished)
        if stopped and not finished:
            assert self.scheduler is not None
            self.scheduler.finish_requests([update.request_id], "stop")
            finished, reason = True, "stop"
        prompt_lps = update.prompt_logprobs or None
        if prompt_lps and tracked.prompt_logprobs_skip:
            skip = min(tracked.prompt_logprobs_skip, len(prompt_lps))
            prompt_lps = prompt_lps[skip:]
            tracked.prompt_logprobs_skip -= skip
        tracked.prompt_logprobs_sent += len(prompt_lps or ())
        if update.new_token_ids:
            self.engine.metrics.tokens_generated(tracked, len(update.new_token_ids), now)
        req = tracked.request
        tracked.queue.put_nowait(
            OutputDelta(
                request_id=update.request_id,
                text=delta,
                token_ids=list(update.new_token_ids),
                logprobs=update.logprobs,
                prompt_logprobs=prompt_lps or None,
                finished=finished,
                finish_reason=reason,
                num_prompt_tokens=req.num_prompt_tokens,
                num_output_tokens=req.num_output_tokens,
                num_cached_tokens=req.num_cached_tokens,
                error=getattr(update, "error", "") or "",
            )
        )
        if finished:
            del self.tracked[update.request_id]
            self.engine.metrics.request_finished(reason, tracked, now)
            log.info(
                "request %s finished (%s): %d prompt tokens (%d cached), %d generated, %.2fs",
                update.request_id, reason, req.num_prompt_tokens, req.num_cached_tokens,
                req.num_output_tokens, now - tracked.arrival,
            )

    async def _recover(self) -> None:
        """Reconnect with backoff; resume every unfinished request by recompute."""
        self.healthy = False
        pending = list(self.tracked.values())
        self.tracked.clear()
        delay = 0.5
        while True:
            try:
                await self.connect(timeout=self.engine.config.reconnect_backoff_max)
                break
            except Exception as exc:  # still down: retry
                log.info("executor %s: reconnect failed (%s); retry in %.1fs", self.address,
                         type(exc).__name__, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.engine.config.reconnect_backoff_max)
        for tracked in pending:
            tracked.request = self.engine.make_request(
                tracked.gen, tracked.request.output_token_ids
            )
            tracked.prompt_logprobs_skip = tracked.prompt_logprobs_sent
            self.add(tracked)
        log.info("executor %s back: resumed %d requests", self.address, len(pending))


class Engine:
    """Routes requests to executors and streams their outputs."""

    def __init__(self, config: ControllerConfig, tokenizer: Tokenizer):
        self.config = config  # controller configuration
        self.tokenizer = tokenizer  # for detokenization
        self.metrics = EngineMetrics(config.served_model_name)  # Prometheus metrics
        self.runners = [ExecutorRunner(self, a) for a in config.executors]  # one per executor
        self.max_model_len = config.max_model_len  # fixed after start()
        self.eos_token_ids: list[int] = list(tokenizer.eos_token_ids)  # from tokenizer + model
        self.num_kv_tokens = 0  # smallest executor KV capacity in tokens

    async def start(self) -> None:
        """Connect to every executor, then start their step loops."""
        await asyncio.gather(
            *(r.connect(self.config.executor_startup_timeout) for r in self.runners)
        )
        infos = [r.info for r in self.runners if r.info is not None]
        self.max_model_len = min(i.model.max_model_len for i in infos)
        for info in infos:
            for eos in info.model.eos_token_ids:
                if eos not in self.eos_token_ids:
                    self.eos_token_ids.append(eos)
        self.num_kv_tokens = min(
            (r.num_blocks - 1) * r.info.kv_cache.block_size for r in self.runners if r.info
        )
        for r in self.runners:
            r.start()

    async def stop(self) -> None:
        await asyncio.gather(*(r.stop() for r in self.runners))

    @property
    def healthy(self) -> bool:
        return any(r.healthy for r in self.runners)

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

    def _place(self) -> ExecutorRunner:
        candidates = [r for r in self.runners if r.healthy]
        if not candidates:
            raise NoExecutorError("no executor is healthy")
        return min(candidates, key=lambda r: r.load)

    async def generate(self, gen: GenerationRequest) -> AsyncIterator[OutputDelta]:
        """Run one request; yields its deltas; aborts it if the consumer goes away."""
        runner = self._place()
        tracked = _Tracked(
            gen=gen,
            queue=asyncio.Queue(),
            text=OutputTextState(
                self.tokenizer, gen.prompt_token_ids, stop=gen.stop,
                include_stop_str_in_output=gen.include_stop_str_in_output,
                skip_special_tokens=gen.skip_special_tokens,
            ),
            request=self.make_request(gen),
            arrival=time.perf_counter(),
        )
        self.metrics.request_arrived(len(gen.prompt_token_ids))
        runner.add(tracked)
        finished = False
        try:
            while not finished:
                delta = await tracked.queue.get()
                finished = delta.finished
                yield delta
        finally:
            if not finished:
                for r in self.runners:
                    if gen.request_id in r.tracked:
                        r.abort(gen.request_id)

    def executors_state(self) -> list[dict]:
        """Per-executor state for /health and the admin endpoint."""
        out = []
        for r in self.runners:
            stats = r.scheduler.stats() if r.scheduler else None
            out.append({
                "address": r.address,
                "healthy": r.healthy,
                "kind": r.info.device_kind if r.info else None,
                "device": r.info.device_name if r.info else None,
                "incarnation": r.info.incarnation_id if r.info else None,
                "num_blocks": r.num_blocks,
                "running": stats.num_running if stats else 0,
                "waiting": stats.num_waiting if stats else 0,
                "kv_usage": stats.kv_usage if stats else 0.0,
                "used_blocks": stats.num_used_blocks if stats else 0,
            })
        return out
