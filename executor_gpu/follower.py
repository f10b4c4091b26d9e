"""A follower rank of a tensor-parallel GPU executor (ranks 1..N-1; see executor_gpu.ranks).

Started by rank 0 in a fresh process, it binds its device, joins the group, builds its shard of
the model with the same runner class rank 0 uses, then does what rank 0's commands say until
rank 0 stops it or dies: load the shard, allocate its KV cache, run each forward pass and
logits projection in lockstep (their collectives meet rank 0's), bind the cache, zero the slots
of failed requests, and report its memory for the KV budget.

A command that fails here ends the process (rank 0 then ends the executor), except lifecycle
commands, whose error goes back to rank 0 in the reply.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from common import logs
from common.host.settings import ExecutorConfig
from common.wire.config import ModelGeometry
from common.wire.model_config import load_model_geometry
from executor_gpu.model_runner import GPUModelRunner, resolve_device
from executor_gpu.ranks.group import (
    Command,
    RankGroup,
    Rendezvous,
    die_with_parent,
    join,
    rank_device,
)
from executor_gpu.ranks.leader_model import on_device

log = logging.getLogger(__name__)


def threads_per_rank(config: ExecutorConfig) -> int:
    """torch threads of each rank on the CPU: the configured count, else the host's cores
    divided between the ranks (N ranks each taking every core would fight over them)."""
    if config.num_threads > 0:
        return config.num_threads
    return max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)


def start_sharded_runner(
    config: ExecutorConfig, geometry: ModelGeometry, device: torch.device
) -> GPUModelRunner:
    """Rank 0's runner over ``config.tensor_parallel_size`` devices: this process takes its
    share of the CPU's cores (on the CPU), the followers are started and joined; the model is
    not loaded yet."""
    if device.type == "cpu":
        torch.set_num_threads(threads_per_rank(config))
    group = RankGroup.start(config, device, follower_main)
    return GPUModelRunner(config, geometry, tp=group.tp, ranks=group)


def follower_main(config: ExecutorConfig, rank: int, rendezvous: Rendezvous) -> None:
    """The follower process: set up, then serve rank 0's commands."""
    die_with_parent()
    logs.configure_logging(
        getattr(config, "log_level", "INFO"),
        getattr(config, "log_format", "text"),
        service=f"executor-rank{rank}",
    )
    device = rank_device(resolve_device(config.device), rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(threads_per_rank(config))
    tp, control = join(rendezvous, rank, device)
    geometry = load_model_geometry(config.model, config.max_model_len, config.served_model_name)
    runner = GPUModelRunner(config, geometry, tp=tp, device=device)
    log.info("rank %d of %d on %s", rank, tp.size, device)
    with torch.inference_mode():
        Follower(runner, control).serve()
    dist.destroy_process_group()  # told to stop: leave the group before the process ends
    # End without the interpreter's teardown: destroying torch's C++ state after the group
    # can abort on a gloo thread still joinable ("terminate called without an active
    # exception"); this rank has nothing left to flush but its logs.
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stderr.flush()
    os._exit(0)


class Follower:
    """Serves rank 0's commands on this rank's runner."""

    def __init__(self, runner: GPUModelRunner, control: Any):
        self.runner = runner  # this rank's shard of model and cache
        self.control = control  # the gloo group commands arrive on
        self.handlers: dict[str, Callable[..., Any]] = {
            "load": self.load,
            "kv": runner.initialize_kv_cache,
            "forward": self.forward,
            "logits": self.logits,
            "bind": self.bind,
            "scrub": self.scrub,
            "mem_begin": self.memory_begin,
            "mem_end": self.memory_end,
            "stop": lambda: None,
        }
        self._memory_base = 0

    def serve(self) -> None:
        """Receive and run commands until "stop"."""
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=self.control)
            command: Command = box[0]
            if not command.reply:
                self.handlers[command.name](*command.args)
            else:
                try:
                    result = self.handlers[command.name](*command.args)
                except Exception as exc:  # told to rank 0, which raises it there
                    log.exception("command %s failed", command.name)
                    result = exc
                dist.gather_object(result, None, dst=0, group=self.control)
            if command.name == "stop":
                return

    def load(self) -> int:
        """Build and load this rank's shard; its weight bytes."""
        self.runner.load_model()
        return self.runner.weights_bytes

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> None:
        """Run the step's forward pass on this rank's shard (its hidden states are rank 0's
        too; nothing is kept)."""
        device = self.runner.device
        self.runner.model(input_ids.to(device), positions.to(device), on_device(meta, device))

    def logits(self, hidden: torch.Tensor) -> None:
        """Project the rows onto this rank's vocabulary slice (gathered to rank 0)."""
        self.runner.model.compute_logits(hidden.to(self.runner.device))

    def bind(self, bound: bool) -> None:
        """Bind this rank's cache, or unbind it."""
        self.runner.model.bind_kv_cache(self.runner.kv_caches if bound else None)

    def scrub(self, slots: torch.Tensor) -> None:
        """Zero these slots of this rank's cache."""
        self.runner.zero_slots(slots.to(self.runner.device))

    def memory_begin(self) -> None:
        """Start measuring this rank's peak memory (CUDA) for a profiling run."""
        device = self.runner.device
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self._memory_base = torch.cuda.memory_allocated(device)

    def memory_end(self) -> dict[str, int]:
        """This rank's memory after the profiling run (see GPUWorker's KV budget)."""
        device = self.runner.device
        if device.type != "cuda":
            return {"weights": self.runner.weights_bytes}
        torch.cuda.synchronize(device)
        peak = max(0, torch.cuda.max_memory_allocated(device) - self._memory_base)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return {
            "weights": self.runner.weights_bytes,
            "peak": peak,
            "free": free,
            "total": total,
            "reserved": torch.cuda.memory_reserved(device),
            "kv_heads": self.runner.local_kv_heads,
        }
