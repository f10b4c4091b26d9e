"""What /health and the admin endpoint show about each executor of the fleet."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from controller.core.snapshot import ExecutorSnapshot


def executor_report(snap: ExecutorSnapshot, now: float | None = None) -> dict:
    """One executor's state for /health and /admin/executors (`now`: monotonic time, for how
    long it has been in its state)."""
    now = time.monotonic() if now is None else now
    return {
        "address": snap.address,
        "source": snap.source,
        "state": snap.state,
        "healthy": snap.healthy,
        "state_seconds": round(now - snap.state_since, 3),
        "kind": snap.kind,
        "device": snap.device,
        "incarnation": snap.incarnation,
        "incarnations": snap.incarnations,
        "tensor_parallel_size": snap.tensor_parallel_size,
        "num_blocks": snap.num_blocks,
        "block_size": snap.block_size,
        "max_num_batched_tokens": snap.max_num_batched_tokens,
        "requests": snap.requests,
        "running": snap.running,
        "waiting": snap.waiting,
        "uncomputed_tokens": snap.uncomputed_tokens,
        "kv_usage": snap.kv_usage,
        "used_blocks": snap.used_blocks,
        "step_overhead_ms": round(snap.overhead * 1e3, 3),
        "per_token_ms": round(snap.per_token * 1e3, 4),
        "tokens_per_second": round(snap.tokens_per_second, 1),
        "steps": snap.steps,
        "tokens": snap.tokens,
        "step_transport": snap.step_transport,
        "requests_placed": snap.requests_placed,
        "prefix_cache_queries": snap.prefix_cache_queries,
        "prefix_cache_hits": snap.prefix_cache_hits,
        "losses": snap.losses,
        "reconnects": snap.reconnects,
        "last_loss": snap.last_loss,
        "connect_error": snap.connect_error,
        "duplicate_of": snap.duplicate_of,
        "owned": snap.owned,
        "owner": snap.owner,
        "assigned_to": snap.assigned_to,
    }
