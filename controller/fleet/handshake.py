"""The handshake with an executor and what it sets up on the controller's side: a fresh
scheduler for the executor, configured from the controller's settings within what the executor
says it can do.

This lives in the fleet, not in core: the scheduler knows nothing of the controller's settings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from controller.core.scheduler import (
    Scheduler,
    SchedulerBase,
    SchedulerConfig,
    load_scheduler_class,
)

if TYPE_CHECKING:
    from common.wire.config import DeviceInfo
    from controller.fleet.client import ExecutorClient, HandshakeResult
    from controller.settings import ControllerConfig


async def handshake(client: ExecutorClient, cfg: ControllerConfig) -> HandshakeResult:
    """InitDevice, ProfileMemory and InitializeCache with the controller's settings."""
    return await client.handshake(
        cfg.max_num_batched_tokens,
        cfg.max_num_seqs,
        cfg.max_model_len,
        cfg.seed,
        cfg.num_kv_blocks,
        cfg.kind_limits,
        timeout=cfg.executor_startup_timeout,
    )


def scheduler_config_for(
    cfg: ControllerConfig, info: DeviceInfo, num_blocks: int
) -> SchedulerConfig:
    """The controller's settings within what one executor says it can do (its kind's limits
    from ``--executor-limits`` first)."""
    caps = info.capabilities
    tokens, seqs = cfg.kind_limits.get(
        info.device_kind, (cfg.max_num_batched_tokens, cfg.max_num_seqs)
    )
    return SchedulerConfig(
        max_num_batched_tokens=min(tokens, caps.max_tokens_per_step),
        max_num_seqs=min(seqs, caps.max_num_seqs),
        long_prefill_token_threshold=cfg.long_prefill_token_threshold,
        policy=cfg.policy,
        enable_prefix_caching=cfg.enable_prefix_caching,
        chunked_prefill=caps.chunked_prefill,
        block_size=info.kv_cache.block_size,
        num_blocks=num_blocks,
        max_model_len=info.model.max_model_len,
        sliding_window=info.model.uniform_window,
    )


def new_scheduler(cfg: ControllerConfig, info: DeviceInfo, num_blocks: int) -> SchedulerBase:
    """A fresh scheduler of the configured class (``--scheduler``, else the default) for the
    executor a handshake described; its block pool is empty."""
    cls = load_scheduler_class(cfg.scheduler_class) if cfg.scheduler_class else Scheduler
    return cls(scheduler_config_for(cfg, info, num_blocks))


def describe(hs: HandshakeResult, restarted: bool, step_tokens: int) -> str:
    """The log line of a finished handshake."""
    info = hs.info
    return (
        f"{info.device_kind} ({info.device_name}), incarnation {info.incarnation_id[:8]}"
        f"{' (new)' if restarted else ' (same process)'}, {hs.num_blocks} KV blocks of "
        f"{info.kv_cache.block_size} tokens, {step_tokens} tokens/step, "
        f"warm-up {hs.warmup_seconds:.1f}s"
    )
