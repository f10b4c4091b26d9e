"""What an executor session shows the rest of the controller: whether it is healthy, what
it can hold, what its prefix cache would serve, and its `ExecutorSnapshot` (placement, the
admin report, metrics). Read-only queries over the session's state, kept apart from its
connection lifecycle (session.py) and its step loop (steps.py): `ExecutorSession` inherits
`SessionView`.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from controller.core.snapshot import ExecutorSnapshot

if TYPE_CHECKING:
    from common.wire.config import DeviceInfo
    from controller.core.scheduler import SchedulerBase
    from controller.fleet.client import ExecutorClient
    from controller.fleet.placed import PlacedRequests
    from controller.fleet.placement import StepCostModel
    from controller.fleet.tracked import Tracked
    from controller.observe.metrics import EngineMetrics, ExecutorSeries
    from controller.settings import ControllerConfig


class SessionState(enum.Enum):
    """Where an executor session stands."""

    CONNECTING = "connecting"  # first handshake not done yet
    HEALTHY = "healthy"  # connected; takes new work
    UNHEALTHY = "unhealthy"  # lost; reconnecting with backoff
    DRAINING = "draining"  # left discovery: finishes its requests, takes no new work
    DUPLICATE = "duplicate"  # another address reaches the same executor: waits, retrying
    OWNED_ELSEWHERE = "owned_elsewhere"  # another controller's lease holds it: waits, retrying
    ASSIGNED_ELSEWHERE = "assigned_elsewhere"  # the division gives it another controller: idle
    REMOVED = "removed"  # gone for good


class SessionView:
    """The queries of one executor session (`ExecutorSession` inherits it); they read the
    session's attributes declared here."""

    address: str  # host:port
    source: str  # how it was found: static, dns or file
    config: ControllerConfig  # enable_prefix_caching
    metrics: EngineMetrics  # binds the metric series
    client: ExecutorClient  # its generation and owner id
    scheduler: SchedulerBase | None  # the current connection's scheduler
    info: DeviceInfo | None  # the latest InitDevice answer
    num_blocks: int  # KV blocks on the device
    max_num_batched_tokens: int  # this executor's step budget
    state: SessionState  # where it stands
    state_since: float  # when state last changed
    tracked: PlacedRequests  # requests placed here
    cost: StepCostModel  # measured step times
    last_loss: str  # why it was last lost
    connect_error: str  # why connection attempts fail
    duplicate_of: str  # the address driving the same executor, while a duplicate
    owned_by: str  # the other controller holding the executor, while it refuses us
    assigned_to: str  # the controller the division gave it ("" = this one)
    incarnations: int  # distinct incarnation ids seen
    losses: int  # times lost
    reconnects: int  # handshakes after a loss
    requests_placed: int  # requests placed here
    steps: int  # steps run
    tokens: int  # tokens computed
    _base_prefix: tuple[int, int]  # prefix-cache (queries, hits) of earlier connections
    _series: ExecutorSeries | None  # bound on first use

    @property
    def healthy(self) -> bool:
        """Connected and taking new work."""
        return self.state is SessionState.HEALTHY

    @property
    def block_size(self) -> int:
        """Tokens per KV block (0 before the first handshake)."""
        return self.info.kv_cache.block_size if self.info else 0

    @property
    def capacity_tokens(self) -> int:
        """Longest sequence this executor can hold (KV pool and model length)."""
        if self.info is None:
            return 0
        return min((self.num_blocks - 1) * self.block_size, self.info.model.max_model_len)

    def fits(self, num_tokens: int, max_length: int = 0) -> bool:
        """Whether a sequence of `num_tokens` known tokens, which may grow to `max_length`,
        could run here to its end (a smaller executor would cut it short)."""
        if self.info is None or max(num_tokens + 1, max_length) > self.capacity_tokens:
            return False
        return self.info.capabilities.chunked_prefill or num_tokens <= self.max_num_batched_tokens

    def prefix_hit(self, hashes: list[bytes], num_tokens: int) -> int:
        """Tokens of a sequence with these block hashes cached here or queued here (exact)."""
        if self.scheduler is None or not self.config.enable_prefix_caching:
            return 0
        cached = self.scheduler.peek_prefix_hit(hashes, num_tokens)
        usable = max(num_tokens - 1, 0) // self.block_size
        return max(cached, self.tracked.queued_blocks(hashes, usable) * self.block_size)

    def snapshot(self, expected_output: float = 0.0) -> ExecutorSnapshot:
        """This executor now, for placement, reports and metrics (`expected_output` caps each
        request's expected output tokens in `decode_tokens`)."""
        sched, info, cost = self.scheduler, self.info, self.cost
        stats = sched.stats() if sched is not None else None
        overhead, per_token = cost.coefficients()
        uncomputed, decode = self.tracked.backlog(expected_output)
        queries, hits = self._base_prefix
        return ExecutorSnapshot(
            address=self.address,
            source=self.source,
            kind=info.device_kind if info else None,
            device=info.device_name if info else None,
            tensor_parallel_size=info.capabilities.tensor_parallel_size if info else 1,
            incarnation=info.incarnation_id if info else None,
            incarnations=self.incarnations,
            state=self.state.value,
            healthy=self.healthy,
            state_since=self.state_since,
            connected=sched is not None,
            max_num_seqs=sched.config.max_num_seqs if sched is not None else 0,
            max_num_batched_tokens=self.max_num_batched_tokens,
            requests=len(self.tracked),
            running=stats.num_running if stats else 0,
            waiting=stats.num_waiting if stats else 0,
            uncomputed_tokens=uncomputed,
            decode_tokens=decode,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            used_blocks=stats.num_used_blocks if stats else 0,
            kv_usage=stats.kv_usage if stats else 0.0,
            overhead=overhead,
            per_token=per_token,
            tokens_per_second=cost.tokens_per_second,
            measured_steps=cost.steps,
            steps=self.steps,
            tokens=self.tokens,
            requests_placed=self.requests_placed,
            prefix_cache_queries=queries + (stats.prefix_cache_queries if stats else 0),
            prefix_cache_hits=hits + (stats.prefix_cache_hits if stats else 0),
            losses=self.losses,
            reconnects=self.reconnects,
            last_loss=self.last_loss,
            connect_error=self.connect_error,
            duplicate_of=self.duplicate_of,
            owned=self.client.generation > 0 and self.scheduler is not None,
            owner=self.client.owner_id if self.scheduler is not None else self.owned_by,
            assigned_to=self.assigned_to,
            step_transport=self.client.step_transport,
        )

    @property
    def series(self) -> ExecutorSeries:
        """Its metric series, bound on first use and again after each handshake (another
        device, another accelerator label, may answer at this address)."""
        series = self._series
        if series is None:
            kind = self.info.device_kind if self.info is not None else "unknown"
            series = self._series = self.metrics.series(self.address, kind)
        return series

    def can_start_now(self, num_tokens: int) -> bool:
        """Whether a request would be admitted by the next step (room, blocks, empty queue)."""
        sched = self.scheduler
        if not self.healthy or sched is None or not self.fits(num_tokens):
            return False
        stats = sched.stats()
        free = self.num_blocks - 1 - stats.num_used_blocks
        return (
            stats.num_waiting == 0
            and stats.num_running < sched.config.max_num_seqs
            and free * self.block_size > num_tokens
        )

    def stale_waiting(self, placed_before: float) -> list[Tracked]:
        """Requests never admitted here that were placed before `placed_before` (monotonic)."""
        return self.tracked.stale_waiting(placed_before)
