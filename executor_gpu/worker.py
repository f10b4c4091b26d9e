"""GPUWorker: binds a CUDA device (or the CPU), sizes the KV cache, runs steps."""

from __future__ import annotations

import logging
import platform
import time

import torch

from common.host.worker_base import WorkerBase
from common.torch.runner import LaunchedStep
from common.wire.config import MemoryProfile
from common.wire.model_config import load_model_geometry
from common.wire.step_types import StepInput, StepOutput
from executor_gpu.follower import start_sharded_runner
from executor_gpu.model_runner import GPUModelRunner, resolve_device
from executor_gpu.ranks.group import RankGroup

log = logging.getLogger(__name__)

#: KV-cache budget on the CPU when the configuration gives none.
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30


def kv_budget(
    ranks: list[dict[str, int]], utilization: float, block_bytes: int, stored_heads: int
) -> int:
    """The executor's KV bytes from each rank's memory after profiling (``total``, ``free``,
    ``reserved``, ``weights``, ``peak`` bytes and its ``kv_heads``): a rank may hold
    total * utilization minus its weights, its peak activations and whatever its device holds
    outside torch (CUDA context, other processes). Every rank stores the same blocks (its heads
    of each), so the rank with the least room for its share bounds the blocks, each of which
    costs the executor ``block_bytes`` (all ranks' heads, ``stored_heads`` of them)."""
    blocks = None
    for r in ranks:
        outside_torch = max(0, (r["total"] - r["free"]) - r["reserved"])
        room = int(r["total"] * utilization) - r["weights"] - r["peak"] - outside_torch
        if len(ranks) == 1:
            return room
        share = block_bytes * r["kv_heads"] // stored_heads  # this rank's bytes of a block
        fits = max(0, room) // share
        blocks = fits if blocks is None else min(blocks, fits)
    return (blocks or 0) * block_bytes


class GPUWorker(WorkerBase):
    """The worker of a GPU executor; falls back to the CPU for development. With
    ``tensor_parallel_size`` N > 1 it is rank 0 of N processes, one per device."""

    ranks: RankGroup | None = None  # the follower ranks (tensor parallelism)

    def init_device(self) -> None:
        """Bind the device, set torch threads, read the model geometry, start the follower
        ranks (tensor parallelism), create the runner."""
        device = resolve_device(self.config.device)
        size = self.config.tensor_parallel_size
        if device.type == "cuda":
            if size > torch.cuda.device_count() - (device.index or 0):
                raise ValueError(
                    f"--tensor-parallel-size {size} needs {size} CUDA devices from {device}; "
                    f"{torch.cuda.device_count()} visible"
                )
            torch.cuda.set_device(device)
            self.device_kind = "gpu"
            self.device_name = torch.cuda.get_device_name(device)
        else:
            self.device_kind = "cpu"
            self.device_name = platform.processor() or platform.machine() or "cpu"
        if size > 1:
            self.device_name = f"{self.device_name} x{size}"
        if self.config.num_threads > 0:
            torch.set_num_threads(self.config.num_threads)
        self.device = device  # the bound device (rank 0's)
        geometry = load_model_geometry(
            self.config.model, self.config.max_model_len, self.config.served_model_name
        )
        if size > 1:
            runner = start_sharded_runner(self.config, geometry, device)
            self.ranks = runner.ranks
        else:
            runner = GPUModelRunner(self.config, geometry)
        self.model_runner = runner

    def determine_available_memory(self) -> MemoryProfile:
        """KV-cache budget: on CUDA, total * gpu_memory_utilization minus the weights, the
        worst-case step's peak activations and memory held outside torch; on the CPU,
        ``config.kv_cache_bytes`` or 2 GiB (the CPU has no allocator statistics to profile)."""
        runner = self.model_runner
        assert isinstance(runner, GPUModelRunner) and runner.get_model() is not None
        if self.device.type != "cuda":
            budget = self.config.kv_cache_bytes or DEFAULT_CPU_KV_CACHE_BYTES
            return MemoryProfile(
                available_kv_bytes=budget,
                weights_bytes=runner.weights_bytes,
                peak_activation_bytes=0,
            )
        torch.cuda.empty_cache()
        if self.ranks is not None:
            self.ranks.call("mem_begin")
        peak = runner.profile_run()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        here = {
            "weights": sum(p.numel() * p.element_size() for p in runner.model.parameters()),
            "peak": peak,
            "free": free,
            "total": total,
            "reserved": torch.cuda.memory_reserved(self.device),
            "kv_heads": runner.local_kv_heads,
        }
        ranks = [here, *(self.ranks.call("mem_end") if self.ranks is not None else [])]
        available = kv_budget(
            ranks,
            self.config.gpu_memory_utilization,
            runner.get_kv_cache_spec().bytes_per_block,
            runner.stored_kv_heads(),
        )
        log.info(
            "KV budget %.2f GiB (weights %.2f GiB, peak activations %.2f GiB)",
            available / 2**30,
            runner.weights_bytes / 2**30,
            peak / 2**30,
        )
        return MemoryProfile(
            available_kv_bytes=max(0, available),
            weights_bytes=runner.weights_bytes,
            peak_activation_bytes=peak,
        )

    def execute_model(self, step: StepInput) -> StepOutput:
        """Run one step on the runner without autograd."""
        return self.finish_step(self.launch_step(step))

    @property
    def overlaps_steps(self) -> bool:
        """The runner's choice (executor_gpu.overlap): on CUDA with one rank by default."""
        runner = self.model_runner
        return isinstance(runner, GPUModelRunner) and runner.overlaps_steps

    def launch_step(self, step: StepInput) -> LaunchedStep:
        """Queue a step's device work on the runner without autograd."""
        assert self.model_runner is not None
        with torch.inference_mode():
            return self.model_runner.launch_step(step)

    def finish_step(self, launched: LaunchedStep) -> StepOutput:
        """A launched step's output (waiting for the device), observed in the step metrics
        from its launch."""
        assert self.model_runner is not None
        with torch.inference_mode():
            output = self.model_runner.finish_step(launched)
        self.metrics.observe(launched.step, time.perf_counter() - launched.started)
        return output

    def step_done(self, launched: LaunchedStep) -> bool:
        """Whether the launched step's results are on the host (its event has passed)."""
        assert self.model_runner is not None
        return self.model_runner.step_done(launched)

    def step_needs_results(self, step: StepInput) -> bool:
        """See ``TorchModelRunner.step_needs_results``."""
        assert self.model_runner is not None
        return self.model_runner.step_needs_results(step)

    def memory_usage(self) -> dict[str, int]:
        """Weights and KV cache; on CUDA also the device's used and total bytes."""
        usage = super().memory_usage()
        if self.device_kind == "gpu":
            free, total = torch.cuda.mem_get_info(self.device)
            usage.update(
                used=total - free, total=total, allocated=torch.cuda.memory_allocated(self.device)
            )
        return usage
