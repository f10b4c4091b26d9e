"""What /health and the admin endpoint show about each executor of the fleet."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from controller.fleet.placement import backlog_of

if TYPE_CHECKING:
    from controller.fleet.session import ExecutorRunner


def executor_report(runner: ExecutorRunner) -> dict:
    """One executor's state for /health and /admin/executors."""
    stats = runner.scheduler.stats() if runner.scheduler else None
    info = runner.info
    overhead, per_token = runner.cost.coefficients()
    queries, hits = runner.prefix_counters()
    return {
        "address": runner.address,
        "source": runner.source,
        "state": runner.state.value,
        "healthy": runner.healthy,
        "state_seconds": round(time.monotonic() - runner.state_since, 3),
        "kind": info.device_kind if info else None,
        "device": info.device_name if info else None,
        "incarnation": info.incarnation_id if info else None,
        "incarnations": runner.incarnations,
        "num_blocks": runner.num_blocks,
        "block_size": runner.block_size,
        "max_num_batched_tokens": runner.max_num_batched_tokens,
        "requests": len(runner.tracked),
        "running": stats.num_running if stats else 0,
        "waiting": stats.num_waiting if stats else 0,
        "uncomputed_tokens": backlog_of(runner, 0)[0],
        "kv_usage": stats.kv_usage if stats else 0.0,
        "used_blocks": stats.num_used_blocks if stats else 0,
        "step_overhead_ms": round(overhead * 1e3, 3),
        "per_token_ms": round(per_token * 1e3, 4),
        "tokens_per_second": round(runner.cost.tokens_per_second, 1),
        "steps": runner.steps,
        "tokens": runner.tokens,
        "requests_placed": runner.requests_placed,
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "losses": runner.losses,
        "reconnects": runner.reconnects,
        "last_loss": runner.last_loss,
        "connect_error": runner.connect_error,
    }
