"""GPUWorker: binds a CUDA device (or the CPU), sizes the KV cache, runs steps."""

from __future__ import annotations

import logging
import platform
import time

import torch

from common.host.worker_base import WorkerBase
from common.wire.config import MemoryProfile
from common.wire.model_config import load_model_geometry
from common.wire.step_types import StepInput, StepOutput
from executor_gpu.model_runner import GPUModelRunner, resolve_device

log = logging.getLogger(__name__)

#: KV-cache budget on the CPU when the configuration gives none.
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30


class GPUWorker(WorkerBase):
    """The worker of a GPU executor; falls back to the CPU for development."""

    def init_device(self) -> None:
        """Bind the device, set torch threads, read the model geometry, create the runner."""
        device = resolve_device(self.config.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            self.device_kind = "gpu"
            self.device_name = torch.cuda.get_device_name(device)
        else:
            self.device_kind = "cpu"
            self.device_name = platform.processor() or platform.machine() or "cpu"
        if self.config.num_threads > 0:
            torch.set_num_threads(self.config.num_threads)
        self.device = device  # the bound device
        geometry = load_model_geometry(
            self.config.model, self.config.max_model_len, self.config.served_model_name
        )
        self.model_runner = GPUModelRunner(self.config, geometry)

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
        peak = runner.profile_run()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        # Whatever the device holds that torch's allocator does not (CUDA context, other
        # processes) also stays unavailable.
        outside_torch = max(0, (total - free) - torch.cuda.memory_reserved(self.device))
        available = (
            int(total * self.config.gpu_memory_utilization)
            - runner.weights_bytes
            - peak
            - outside_torch
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
        assert self.model_runner is not None
        started = time.perf_counter()
        with torch.inference_mode():
            output = self.model_runner.execute_model(step)
        self.metrics.observe(step, time.perf_counter() - started)
        return output

    def memory_usage(self) -> dict[str, int]:
        """Weights and KV cache; on CUDA also the device's used and total bytes."""
        usage = super().memory_usage()
        if self.device_kind == "gpu":
            free, total = torch.cuda.mem_get_info(self.device)
            usage.update(
                used=total - free, total=total, allocated=torch.cuda.memory_allocated(self.device)
            )
        return usage
